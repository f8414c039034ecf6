"""Decode throughput: M* serving a Llama vs transformers `generate` and vs a bare dense-KV torch loop.

A Llama of realistic CPU shape (hidden 512, 8 layers, GQA 8/4, vocab 16384) with seeded random
weights, written in HF layout and loaded by both sides. M* is the whole runtime as an integrator
embeds it: the `llama` model on an `AsyncEngine`, requests through `submit`, each generated token
fed back through the conductor's decode loop to the `kvcache` engine. All in this run:
  * mixed prompt/output lengths (prompts 16-64 tokens, outputs 16-256; --quick: 8-32 and 8-96)
    at 1, 8 and 32 concurrent requests: a client keeps N requests in flight until `waves` x N
    have been served (6 waves by default, 2 with --quick; the last wave drains with fewer than N
    in flight, which weighs more the fewer waves there are). M* refills a finished request's
    slot at once; HF `generate` gets the same requests in batches of N with left padding (each
    batch runs to its longest output; tokens/s counts only the tokens asked for);
    Beside each whole-run figure, the steady state (`*_steady_*`): tokens/s over the full-batch
    decode steps, i.e. steps that run one token per row and where every row yields a token someone
    asked for. `generate`: each batch's decode steps 2..min(outputs), timed by a streamer (its
    prefill step left out). M*: engine steps that answered N requests and ran nothing else, timed end
    to end including the runtime between steps; steps carrying a refill's prefill chunk are left
    out, as `generate`'s prefill is (until session 5 they counted, so M*'s window held prefill work
    that `generate`'s did not: 0.68 in the quiet full run). The windows still favour `generate`:
    its steps are the first of each batch, over the shortest KV of its run, while M*'s span every KV
    length. `--profile` compares one step of each at equal KV lengths, and its roofline says how far
    any fp32 step can beat `generate`'s on this CPU;
  * framework tax: 32 requests of equal prompt and output length decoded in lockstep, M* against
    a bare loop over the same decoder (the same module, so the same packed weights) with a
    preallocated dense KV cache, the decode attention kernel M*'s lanes use, and no framework;
  * compiled steps: the same lockstep on a second engine with `compile: true` (the 32-row decode
    step compiled by inductor, prefill eager): `compiled_speedup` is its full-batch decode tokens/s
    over the eager engine's, `compile_s` what compiling took (0 when no C++ compiler: it runs eager).
Each dtype of `--dtype` (default fp32 then bf16; both sides load the same weights in it) gets every figure; bf16's keys
end in `_bf16`, and the CPU flags are printed (bf16 is a speed claim only on a CPU with bf16 units).
Greedy decoding everywhere; no prefix caching (runs repeat prompts). Beside each wall-time figure, process CPU
per token (`*_cpu_ms_per_tok_*`, `vs_hf_generate_cpu_*`: least over the repeats), which other jobs on a shared
machine disturb far less than wall time, and the load average at start and end. Prints one final JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from collections import deque

import torch
import torch.nn.functional as F
from decode_profile import StepStamps  # (benchmarks/ is on the path when a script here runs)
from mstar_attn_torch.backend import decode_attention

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPE = dict(
    vocab_size=16384,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def load_models(directory: str, dtype: str = "float32"):
    """The same seeded weights as a transformers model and as M*'s served `llama` model (through M*'s loader), in `dtype`."""
    import transformers
    from mstar_llm.model import load_llm
    from mstar_llm.preset import build_tokenizer

    from mstar_core.model import LoadOptions

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).eval()
    hf.save_pretrained(directory)
    build_tokenizer().save(os.path.join(directory, "tokenizer.json"))  # the server wants one; prompts are ids
    ours = load_llm(LoadOptions(checkpoint=directory, dtype=dtype), progress=False)
    return hf.to(getattr(torch, dtype)), ours


def workload(n: int, prompt_range, output_range, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, SHAPE["vocab_size"]) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
    outputs = [rng.randint(*output_range) for _ in range(n)]
    return prompts, outputs


ENGINE_EXTRA: dict = {}  # settings every engine of this run gets (--unpacked)


async def start_engine(loaded, pages: int, **extra):
    """M* as an integrator embeds it: an `AsyncEngine` serving the model; requests go through the conductor."""
    from mstar_core.runtime import AsyncEngine

    engine = AsyncEngine()
    # no prefix caching: runs repeat the same prompts, and a cache hit would skip prefill HF has to do
    settings = {"num_pages": pages, "page_size": 16, "max_num_batched_tokens": 512, "max_num_seqs": 64,
                "enable_prefix_caching": False, **ENGINE_EXTRA, **extra}
    await engine.add_model(loaded, settings={"lm": settings})
    return engine


class StepClock:
    """Timestamps every kvcache engine step (end time, requests answered, tokens run) for the steady-state figures."""

    def __init__(self):
        from mstar_kvcache import KVCacheEngine

        self.cls, self.original, self.original_run = KVCacheEngine, KVCacheEngine.step, KVCacheEngine._run
        self.events: list[tuple[float, int, int]] = []
        self.engines: list = []
        self.t0 = time.perf_counter()
        self.tokens = 0
        clock = self

        def run(engine, work):
            clock.tokens += sum(n for _, n in work)
            return clock.original_run(engine, work)

        def step(engine):
            clock.tokens = 0
            results = clock.original(engine)
            clock.events.append((time.perf_counter(), len(results), clock.tokens))
            if engine not in clock.engines:
                clock.engines.append(engine)
            return results

        KVCacheEngine.step, KVCacheEngine._run = step, run

    def start(self) -> None:
        self.events, self.t0 = [], time.perf_counter()

    def steady(self, full: int) -> tuple[int, float]:
        """(tokens, seconds) over the full-batch decode steps, each timed from the previous step's end.

        A full-batch decode step answered `full` requests and ran no other tokens: a step carrying a
        refill's prefill chunk is left out, as `generate`'s prefill step is left out of its window.
        """
        tokens, seconds, prev = 0, 0.0, self.t0
        for end, answered, ran in self.events:
            if answered >= full and ran == answered:
                tokens, seconds = tokens + answered, seconds + end - prev
            prev = end
        return tokens, seconds

    def restore(self) -> None:
        self.cls.step, self.cls._run = self.original, self.original_run


CLOCK: StepClock | None = None


async def run_mstar(engine, prompts, outputs, concurrency: int | None = None) -> tuple[float, int]:
    """Requests through `AsyncEngine.submit`; a client keeps `concurrency` of them in flight."""
    if CLOCK is not None:
        CLOCK.start()
    queue = deque(range(len(prompts)))
    made = 0

    async def client() -> None:
        nonlocal made
        while queue:
            i = queue.popleft()
            handle = engine.submit("llama", {"input_ids": prompts[i], "max_tokens": outputs[i], "ignore_eos": True})
            async for out in handle:
                made += out.name == "next_token"

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(min(concurrency or len(prompts), len(prompts)))))
    return time.perf_counter() - start, made


HF_STEADY: list[tuple[int, float]] = []  # (tokens, seconds) of each batch's full steps, for the last run_hf


def run_hf(hf, prompts, outputs, concurrency: int | None = None) -> tuple[float, int]:
    """Left-padded `generate` over batches of `concurrency` requests, each run to its longest requested output."""
    size = concurrency or len(prompts)
    HF_STEADY.clear()
    start = time.perf_counter()
    for lo in range(0, len(prompts), size):
        batch, wanted = prompts[lo : lo + size], outputs[lo : lo + size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        stamps = StepStamps()
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=max(wanted), min_new_tokens=max(wanted),
                        do_sample=False, eos_token_id=None, pad_token_id=0, streamer=stamps)
        # decode steps 2..full give every row a token it asked for (step 1 is the batch's prefill, not steady)
        full = min(wanted)
        HF_STEADY.append((len(batch) * (full - 1), stamps.times[full] - stamps.times[1]))
    return time.perf_counter() - start, sum(outputs)


class DenseKV:
    """The bare loop's cache: `[B, Hkv, max_len, D]` per layer, all sequences at the same position."""

    def __init__(self, layers, batch, kv_heads, max_len, head_dim, dtype=torch.float32):
        self.k = torch.zeros(layers, batch, kv_heads, max_len, head_dim, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.batch, self.pos, self.step_len = batch, 0, 0

    def attend(self, layer, q, k, v, scale):
        b, n = self.batch, self.step_len
        q = q.view(b, n, *q.shape[1:]).transpose(1, 2)
        end = self.pos + n
        self.k[layer, :, :, self.pos : end] = k.view(b, n, *k.shape[1:]).transpose(1, 2)
        self.v[layer, :, :, self.pos : end] = v.view(b, n, *v.shape[1:]).transpose(1, 2)
        if n == 1:  # decode: the kernel M*'s lanes use (the same kernels on both sides of vs_bare_loop)
            return decode_attention(q[:, :, 0], self.k[layer, :, :, :end], self.v[layer, :, :, :end], None, scale)
        out = F.scaled_dot_product_attention(q, self.k[layer, :, :, :end], self.v[layer, :, :, :end],
                                             is_causal=n > 1, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * n, q.shape[1], q.shape[-1])


def run_bare(model, prompts, steps, stamps: list[float] | None = None) -> tuple[float, int]:
    """Lockstep greedy decoding of equal-length prompts with a dense KV cache and nothing else.

    `stamps`, when given, gets the thread CPU time after each step (prefill first), like `StepStamps`.
    """
    cfg = model.config
    b, p = len(prompts), len(prompts[0])
    dtype = next(model.parameters()).dtype
    cache = DenseKV(cfg.num_hidden_layers, b, cfg.num_key_value_heads, p + steps, cfg.head_dim, dtype)
    ids = torch.tensor(prompts).reshape(-1)
    positions = torch.arange(p).repeat(b)
    start = time.perf_counter()
    with torch.inference_mode():
        cache.step_len = p
        hidden = model(ids, positions, cache)
        last = hidden.view(b, p, -1)[:, -1]
        for i in range(steps):
            token = model.compute_logits(last).argmax(-1)
            if stamps is not None:
                stamps.append(time.thread_time())
            if i == steps - 1:
                break
            cache.pos += cache.step_len
            cache.step_len = 1
            last = model(token, torch.full((b,), cache.pos), cache)
    return time.perf_counter() - start, b * steps


async def best_of(repeats: int, *sides, steady=None):
    """Alternate the sides `repeats` times and keep each side's fastest run (shared machines are noisy).

    `steady[i]`, when given, reads side i's steady-state (tokens, seconds) right after its run; the
    best steady rate per side is kept in `best_steady`, the least process CPU per token in `best_cpu`
    (both threads of M*; what other jobs on a shared machine disturb far less than wall time).
    """
    best = [None] * len(sides)
    best_steady.clear()
    best_steady.extend([0.0] * len(sides))
    best_cpu.clear()
    best_cpu.extend([float("inf")] * len(sides))
    for _ in range(repeats):
        for i, side in enumerate(sides):
            cpu = time.process_time()
            result = side()
            took, made = await result if asyncio.iscoroutine(result) else result
            best_cpu[i] = min(best_cpu[i], (time.process_time() - cpu) / made)
            if best[i] is None or took < best[i][0]:
                best[i] = (took, made)
            if steady is not None and steady[i] is not None:
                tokens, seconds = steady[i]()
                if seconds > 0:
                    best_steady[i] = max(best_steady[i], tokens / seconds)
    return best


best_steady: list[float] = []
best_cpu: list[float] = []  # process CPU seconds per token, per side


def hf_steady() -> tuple[int, float]:
    return sum(t for t, _ in HF_STEADY), sum(s for _, s in HF_STEADY)


#: Key suffix of each dtype's figures: fp32's keep their historical names, bf16's end in `_bf16`.
SUFFIX = {"float32": "", "bfloat16": "_bf16", "float16": "_fp16"}


async def main_async(args) -> dict:
    """Every figure for each dtype of `--dtype` in turn (the CPU flags say whether bf16 has hardware units here)."""
    from vs_vllm import cpu_flags

    load_start = os.getloadavg()[0]
    out: dict = {"benchmark": "decode_throughput", "quick": args.quick, "threads": args.threads,
                 "packed": not args.unpacked, "dtypes": args.dtype}
    for dtype in args.dtype:
        figures = await dtype_figures(args, dtype)
        out.update({k if k in ("benchmark", "mode", "quick", "threads", "waves", "packed") else k + SUFFIX[dtype]: v
                    for k, v in figures.items()})
    out["cpu_flags"] = cpu_flags()
    out["load_avg"] = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    return out


async def dtype_figures(args, dtype: str) -> dict:
    torch.set_num_threads(args.threads)
    if args.unpacked:
        ENGINE_EXTRA["pack_weights"] = False
    load_start = os.getloadavg()[0]
    print(f"== {dtype}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf, loaded = load_models(tmp, dtype)
    if args.profile:
        from decode_profile import Sides, profile

        p_len, steps = (32, 16) if args.quick else (64, 32)
        sides = Sides(start_engine, run_bare, run_mstar, SHAPE["vocab_size"])
        figures = await profile(hf, loaded, p_len, steps, args.repeats, sides)
        return {"benchmark": "decode_throughput", "mode": "profile", "quick": args.quick, "threads": args.threads,
                "packed": not args.unpacked,
                "load_avg": [round(load_start, 2), round(os.getloadavg()[0], 2)], **figures}
    decoder = loaded.graph.nodes["lm"].module()
    if args.quick:
        prompt_range, output_range, lock = (8, 32), (8, 96), (16, 32)
    else:
        prompt_range, output_range, lock = (16, 64), (16, 256), (32, 128)
    # room for 32 requests of the longest prompt and output at once, plus the lockstep run's
    pages = 32 * -(-(prompt_range[1] + output_range[1]) // 16) + 64
    global CLOCK
    CLOCK = StepClock()
    engine = await start_engine(loaded, pages)
    figures: dict[str, float] = {}
    try:
        await run_mstar(engine, *workload(2, (4, 8), (2, 4), 99))  # warm-up

        for n in (1, 8, 32):
            prompts, outputs = workload(args.waves * n, prompt_range, output_range, seed=n)
            (t_m, tok_m), (t_h, tok_h) = await best_of(
                args.repeats, lambda p=prompts, o=outputs, c=n: run_mstar(engine, p, o, c),
                lambda p=prompts, o=outputs, c=n: run_hf(hf, p, o, c), steady=[lambda c=n: CLOCK.steady(c), hf_steady])
            assert tok_m == sum(outputs), f"M* made {tok_m} tokens, {sum(outputs)} were asked for"
            steady_m, steady_h = best_steady
            cpu_m, cpu_h = best_cpu
            figures[f"mstar_cpu_ms_per_tok_{n}"] = round(1e3 * cpu_m, 3)
            figures[f"hf_cpu_ms_per_tok_{n}"] = round(1e3 * cpu_h, 3)
            figures[f"vs_hf_generate_cpu_{n}"] = round(cpu_h / cpu_m, 3)
            figures[f"mstar_tok_s_{n}"] = round(tok_m / t_m, 1)
            figures[f"hf_tok_s_{n}"] = round(tok_h / t_h, 1)
            figures[f"vs_hf_generate_{n}"] = round((tok_m / t_m) / (tok_h / t_h), 3)
            figures[f"mstar_steady_tok_s_{n}"] = round(steady_m, 1)
            figures[f"hf_steady_tok_s_{n}"] = round(steady_h, 1)
            figures[f"vs_hf_generate_steady_{n}"] = round(steady_m / steady_h, 3)
            print(f"concurrency {n:2d}: M* {tok_m / t_m:8.1f} tok/s   HF generate {tok_h / t_h:8.1f} tok/s   "
                  f"full batch: M* {steady_m:8.1f}   HF {steady_h:8.1f}", flush=True)
        p_len, steps = lock
        prompts = [[(7 * i + j) % SHAPE["vocab_size"] + 1 for j in range(p_len)] for i in range(32)]
        (t_b, tok_b), (t_m, tok_m) = await best_of(args.repeats, lambda: run_bare(decoder, prompts, steps),
                                                   lambda: run_mstar(engine, prompts, [steps] * 32),
                                                   steady=[None, lambda: CLOCK.steady(32)])
        eager_steady = best_steady[1]
        figures["mstar_lockstep_cpu_ms_per_tok_32"] = round(1e3 * best_cpu[1], 3)
        figures["bare_cpu_ms_per_tok_32"] = round(1e3 * best_cpu[0], 3)
        figures["bare_tok_s_32"] = round(tok_b / t_b, 1)
        figures["mstar_lockstep_tok_s_32"] = round(tok_m / t_m, 1)
        print(f"lockstep 32: M* {tok_m / t_m:8.1f} tok/s   bare loop {tok_b / t_b:8.1f} tok/s", flush=True)
        figures["vs_hf_generate"] = figures["vs_hf_generate_32"]
        figures["vs_hf_generate_steady"] = figures["vs_hf_generate_steady_32"]
        figures["vs_bare_loop"] = round((tok_m / t_m) / (tok_b / t_b), 3)
        figures.update(await compiled_figures(loaded, pages, prompts, steps, args.repeats, eager_steady))
    finally:
        CLOCK.restore()
        await engine.close()
    return {"benchmark": "decode_throughput", "quick": args.quick, "threads": args.threads, "waves": args.waves,
            "packed": not args.unpacked,
            "load_avg": [round(load_start, 2), round(os.getloadavg()[0], 2)], **figures}


async def compiled_figures(loaded, pages, prompts, steps, repeats, eager_steady) -> dict[str, float]:
    """The lockstep on an engine with `compile: true` (decode bucket 32; prefill chunks run eager)."""
    engine = await start_engine(loaded, pages, compile=True, compile_buckets=[32])
    try:
        CLOCK.engines.clear()
        started = time.perf_counter()
        await run_mstar(engine, prompts[:32], [4] * 32)  # first 32-row decode step compiles
        warm = time.perf_counter() - started
        forward = CLOCK.engines[0].forward_fn
        compile_s = getattr(forward, "compile_seconds", 0.0)
        (t_c, tok_c), = await best_of(repeats, lambda: run_mstar(engine, prompts, [steps] * 32),
                                      steady=[lambda: CLOCK.steady(32)])
        compiled_steady = best_steady[0]
    finally:
        await engine.close()
    eager = getattr(forward, "eager_reason", None)
    print(f"compiled lockstep 32: {tok_c / t_c:8.1f} tok/s; full-batch decode {compiled_steady:.1f} vs eager "
          f"{eager_steady:.1f} tok/s; compiling took {compile_s:.1f} s (warm-up run {warm:.1f} s)"
          + (f"; ran eager: {eager}" if eager else ""), flush=True)
    return {"compiled_lockstep_tok_s_32": round(tok_c / t_c, 1), "compiled_steady_tok_s_32": round(compiled_steady, 1),
            "compiled_speedup": round(compiled_steady / eager_steady, 3), "compile_s": round(compile_s, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter sequences (under a minute on 2 cores)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per side, alternating; best kept")
    parser.add_argument("--waves", type=int, default=None,
                        help="requests per concurrency level, in multiples of the level (default 2 quick, 6 full)")
    parser.add_argument("--threads", type=int, default=max(1, min(4, (os.cpu_count() or 2) // 2)),
                        help="torch intra-op threads (default: half the cores, at most 4)")
    parser.add_argument("--unpacked", action="store_true",
                        help="engines with pack_weights: false (MKL repacks wide weights every call, as before session 5)")
    parser.add_argument("--dtype", default=None,
                        help="comma-separated weight/KV dtypes, each run in turn (default float32,bfloat16; "
                             "--quick and --profile: float32); bf16 figures end in _bf16")
    parser.add_argument("--profile", action="store_true",
                        help="only the per-step profile and roofline at batch 32 (see decode_profile.py)")
    args = parser.parse_args()
    args.repeats = args.repeats or (3 if args.profile else 1 if args.quick else 2)
    args.waves = args.waves or (2 if args.quick else 6)
    args.dtype = (args.dtype or ("float32" if args.quick or args.profile else "float32,bfloat16")).split(",")
    bad = [d for d in args.dtype if d not in SUFFIX]
    if bad:
        parser.error(f"--dtype {','.join(bad)}: use float32, bfloat16 or float16")
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
