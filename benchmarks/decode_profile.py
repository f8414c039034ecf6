"""`decode_throughput.py --profile`: one 32-row decode step of M*, `generate` and the bare loop, and its floor.

All three sides decode the same 32 equal prompts in lockstep, so decode step i attends over the
same prompt + i keys everywhere. Per step, thread CPU time (what other jobs on a shared machine
disturb least), least over `rounds` alternating rounds, then the median over the window's steps:
  * `generate`: transformers' eager `generate`, timed by a streamer (decode steps 1..steps-1);
  * bare: the same decoder as M* over a dense KV cache, argmax, nothing else;
  * M*: the `kvcache` engine's step on its thread, split into the module forward, LM head +
    sampling, and the rest (batch building, attention plan, answers); plus the process CPU between
    steps outside the engine (conductor, request handles: the runtime's per-step cost).
And the roofline: the step's weight GEMMs alone (the decoder's weights at the step's shapes, every
layer plus the LM head; through `F.linear` as `generate` runs them, and with every weight prepacked
for oneDNN, the fastest fp32 GEMM this torch has) and attention alone (M*'s decode attention over
contiguous keys of the window's middle KV length, every layer). `steady_ceiling` = `generate`'s step over the faster GEMMs + attention: no
fp32 step can beat `generate`'s step by more than that on this CPU, whatever runs around the GEMMs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from mstar_core.nn.packed import packing_available


class StepStamps:
    """A `generate` streamer used as a clock: `put` is called with the prompt, then once per generated step."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock  # wall time by default; the profile reads the thread's CPU time
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(self.clock())

    def end(self) -> None:
        pass


class EngineSteps:
    """Per kvcache step on the engine thread: thread CPU of the step, its forward, its sampling; process CPU at its end."""

    def __init__(self):
        from mstar_kvcache import KVCacheEngine
        from mstar_kvcache.answers import CallAnswers
        from mstar_kvcache.step_inputs import StepForward

        # (class, method) of the step, its forward and its sampling: each engine's parts are these classes' instances
        self.owners = {"step": KVCacheEngine, "_forward": StepForward, "_sample": CallAnswers}
        self.methods = {"step": "step", "_forward": "run", "_sample": "sample"}
        self.saved = {name: getattr(cls, self.methods[name]) for name, cls in self.owners.items()}
        self.rows: list[dict[str, float]] = []
        self.current: dict[str, float] = {}
        rec = self

        def timed(name):
            original = rec.saved[name]

            def wrapper(part, *args):
                started = time.thread_time()
                try:
                    return original(part, *args)
                finally:
                    rec.current[name] = rec.current.get(name, 0.0) + time.thread_time() - started
            return wrapper

        forward, sample = timed("_forward"), timed("_sample")
        original_step = self.saved["step"]

        def step(engine):
            rec.current = {}
            started = time.thread_time()
            results = original_step(engine)
            rec.rows.append({"answered": len(results), "step": time.thread_time() - started,
                             "forward": rec.current.get("_forward", 0.0), "sample": rec.current.get("_sample", 0.0),
                             "process_end": time.process_time()})
            return results

        for name, fn in (("step", step), ("_forward", forward), ("_sample", sample)):
            setattr(self.owners[name], self.methods[name], fn)

    def restore(self) -> None:
        for name, fn in self.saved.items():
            setattr(self.owners[name], self.methods[name], fn)


def _median_of_least(runs: list[list[float]]) -> float:
    """Least over the rounds per step index, then the median over the steps (seconds)."""
    return statistics.median(min(col) for col in zip(*runs, strict=True))


def gemm_floor(decoder, batch: int, reps: int, packed: bool) -> float:
    """Seconds of one step's weight GEMMs alone: every projection of every layer and the LM head at `batch` rows.

    `packed`: through oneDNN with every weight prepacked (`mstar_core.nn.packed`), else `F.linear` (MKL).
    """
    weights = [m.weight.detach() for m in decoder.modules() if isinstance(m, torch.nn.Linear)]
    if decoder.lm_head is None:  # tied: the LM head is the embedding matrix
        weights.append(decoder.model.embed_tokens.weight.detach())
    xs = [torch.randn(batch, w.shape[1]) for w in weights]
    if packed:
        packs = [torch.ops.mkldnn._reorder_linear_weight(w, batch) for w in weights]
        run = lambda x, i: torch.ops.mkldnn._linear_pointwise(x, packs[i], None, "none", [], "")  # noqa: E731
    else:
        run = lambda x, i: F.linear(x, weights[i])  # noqa: E731
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps):
            started = time.thread_time()
            for i, x in enumerate(xs):
                run(x, i)
            best = min(best, time.thread_time() - started)
    return best


def attention_floor(cfg, batch: int, kv_len: int, reps: int) -> float:
    """Seconds of one step's attention alone: a 1-token query per row over `kv_len` contiguous keys, every layer."""
    from mstar_attn_torch.backend import decode_attention

    q = torch.randn(batch, cfg.num_attention_heads, cfg.head_dim)
    k = torch.randn(batch, cfg.num_key_value_heads, kv_len, cfg.head_dim)
    v = torch.randn_like(k)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps):
            started = time.thread_time()
            for _ in range(cfg.num_hidden_layers):
                decode_attention(q, k, v, None, cfg.head_dim**-0.5)  # the kernel M*'s decode lanes run
            best = min(best, time.thread_time() - started)
    return best


class Sides(NamedTuple):
    """How the caller (`decode_throughput.py`) runs each side: this module imports nothing from it."""

    start_engine: Callable[..., Awaitable[Any]]  # (loaded, pages, **kvcache settings) -> an AsyncEngine serving it
    run_bare: Callable[..., Any]  # (decoder, prompts, steps, stamps) -> (seconds, tokens)
    run_mstar: Callable[..., Awaitable[Any]]  # (engine, prompts, outputs) -> (seconds, tokens)
    vocab_size: int


async def profile(hf, loaded, p_len: int, steps: int, rounds: int, sides: Sides) -> dict[str, float]:
    """The figures above, for 32 prompts of `p_len` tokens decoding `steps` tokens each."""
    # a token budget that prefills all 32 prompts in one step, so every decode step is all 32 rows in lockstep
    engine = await sides.start_engine(loaded, 32 * -(-(p_len + steps) // 16) + 16, max_num_batched_tokens=32 * p_len)
    try:
        return await _profile(hf, loaded, engine, p_len, steps, rounds, sides)
    finally:
        await engine.close()


async def _profile(hf, loaded, engine, p_len: int, steps: int, rounds: int, sides: Sides) -> dict[str, float]:
    decoder = loaded.graph.nodes["lm"].module()
    batch = 32
    prompts = [[(7 * i + j) % sides.vocab_size + 1 for j in range(p_len)] for i in range(batch)]
    ids = torch.tensor(prompts)
    hf_runs, bare_runs = [], []
    mstar = {key: [] for key in ("step", "forward", "sample", "rest", "between")}
    recorder = EngineSteps()
    try:
        for _ in range(rounds):
            stamps = StepStamps(time.thread_time)
            with torch.no_grad():
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
                            do_sample=False, eos_token_id=None, pad_token_id=0, streamer=stamps)
            hf_runs.append([b - a for a, b in zip(stamps.times[1:-1], stamps.times[2:], strict=True)])
            bare: list[float] = []
            sides.run_bare(decoder, prompts, steps, bare)
            bare_runs.append([b - a for a, b in zip(bare[:-1], bare[1:], strict=True)])
            recorder.rows.clear()
            await sides.run_mstar(engine, prompts, [steps] * batch)
            # one prefill step (every prompt's first token), then the decode steps 1..steps-1
            decode = recorder.rows[-steps:]
            assert len(recorder.rows) == steps and all(r["answered"] == batch for r in decode), \
                [r["answered"] for r in recorder.rows]
            mstar["step"].append([r["step"] for r in decode[1:]])
            mstar["forward"].append([r["forward"] for r in decode[1:]])
            mstar["sample"].append([r["sample"] for r in decode[1:]])
            mstar["rest"].append([r["step"] - r["forward"] - r["sample"] for r in decode[1:]])
            mstar["between"].append([b["process_end"] - a["process_end"] - b["step"]
                                     for a, b in zip(decode[:-1], decode[1:], strict=True)])
    finally:
        recorder.restore()
    hf_step, bare_step = _median_of_least(hf_runs), _median_of_least(bare_runs)
    m = {key: _median_of_least(runs) for key, runs in mstar.items()}
    gemm = gemm_floor(decoder, batch, 5 * rounds, packed=False)
    gemm_packed = gemm_floor(decoder, batch, 5 * rounds, packed=True) if packing_available() else gemm
    attention = attention_floor(decoder.config, batch, p_len + steps // 2, 5 * rounds)
    ms = lambda s: round(1e3 * s, 2)  # noqa: E731
    figures = {
        "profile_kv_lens": [p_len + 1, p_len + steps - 1],
        "hf_step_cpu_ms": ms(hf_step), "bare_step_cpu_ms": ms(bare_step),
        "mstar_step_cpu_ms": ms(m["step"] + m["between"]),
        "mstar_engine_step_cpu_ms": ms(m["step"]), "mstar_forward_cpu_ms": ms(m["forward"]),
        "mstar_sample_cpu_ms": ms(m["sample"]), "mstar_engine_rest_cpu_ms": ms(m["rest"]),
        "mstar_between_steps_cpu_ms": ms(m["between"]),
        "gemm_floor_ms": ms(gemm), "gemm_floor_packed_ms": ms(gemm_packed), "attention_floor_ms": ms(attention),
        "step_vs_hf": round(hf_step / (m["step"] + m["between"]), 3),
        "step_vs_bare": round(bare_step / (m["step"] + m["between"]), 3),
        "steady_ceiling": round(hf_step / (min(gemm, gemm_packed) + attention), 3),
    }
    print("per 32-row decode step, thread CPU ms (median over the window of the least over rounds): "
          f"generate {figures['hf_step_cpu_ms']}, bare {figures['bare_step_cpu_ms']}, M* {figures['mstar_step_cpu_ms']} "
          f"(forward {figures['mstar_forward_cpu_ms']}, LM head + sampling {figures['mstar_sample_cpu_ms']}, "
          f"engine rest {figures['mstar_engine_rest_cpu_ms']}, runtime between steps {figures['mstar_between_steps_cpu_ms']}); "
          f"floor: GEMMs {figures['gemm_floor_ms']} (packed {figures['gemm_floor_packed_ms']}) + attention "
          f"{figures['attention_floor_ms']}; generate's step / floor = {figures['steady_ceiling']}", flush=True)
    return figures
