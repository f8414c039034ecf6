"""Where decode throughput goes: M*'s framework tax in back-to-back pairs, and full-batch vs whole-run speed.

Same model and workloads as `decode_throughput.py` (which this imports), M* through `AsyncEngine`:
  * lockstep pairs: 32 requests of equal length, the bare dense-KV loop then M*, `--pairs` times;
    each pair's ratio, and the share of M*'s wall time spent inside the engine's steps (the rest
    is the runtime around it: conductor, scheduler, request handles);
  * mixed workload at 32 concurrent over `--waves` waves: M*'s overall tokens/s against its
    tokens/s over the steps that ran with at least 28 requests (what the drain of the last wave
    costs). No HF run here; `decode_throughput.py` has that comparison.
Prints one final JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time

import torch
from decode_throughput import SHAPE, load_models, run_bare, run_mstar, start_engine, workload


class StepTimer:
    """Wraps the kvcache engine's `step` to record (rows answered, seconds) per step."""

    def __init__(self):
        from mstar_kvcache import KVCacheEngine

        self.cls, self.original, self.steps = KVCacheEngine, KVCacheEngine.step, []
        timer = self

        def step(engine):
            started = time.perf_counter()
            results = timer.original(engine)
            timer.steps.append((len(results), time.perf_counter() - started))
            return results

        KVCacheEngine.step = step

    def restore(self) -> None:
        self.cls.step = self.original


async def main_async(args) -> dict:
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        _, loaded = load_models(tmp)
    decoder = loaded.graph.nodes["lm"].module()
    prompt_range, output_range, (p_len, steps) = ((8, 32), (8, 96), (16, 32)) if args.quick else \
        ((16, 64), (16, 256), (32, 128))
    engine = await start_engine(loaded, 32 * -(-(prompt_range[1] + output_range[1]) // 16) + 64)
    timer = StepTimer()
    try:
        await run_mstar(engine, *workload(2, (4, 8), (2, 4), 99))  # warm-up
        prompts = [[(7 * i + j) % SHAPE["vocab_size"] + 1 for j in range(p_len)] for i in range(32)]
        ratios, shares = [], []
        for _ in range(args.pairs):
            t_b, n_b = run_bare(decoder, prompts, steps)
            timer.steps.clear()
            t_m, n_m = await run_mstar(engine, prompts, [steps] * 32)
            ratios.append((n_m / t_m) / (n_b / t_b))
            shares.append(sum(dt for _, dt in timer.steps) / t_m)
            print(f"lockstep pair: bare {n_b / t_b:7.1f} tok/s  M* {n_m / t_m:7.1f} tok/s  ratio {ratios[-1]:.3f}  "
                  f"engine steps {shares[-1]:.1%} of M*'s wall", flush=True)
        timer.steps.clear()
        t_mix, n_mix = await run_mstar(engine, *workload(args.waves * 32, prompt_range, output_range, seed=32), 32)
        full = [(n, dt) for n, dt in timer.steps if n >= 28]
        full_tok_s = sum(n for n, _ in full) / sum(dt for _, dt in full)
        print(f"mixed, 32 concurrent, {args.waves} waves: {n_mix / t_mix:.1f} tok/s overall, {full_tok_s:.1f} tok/s "
              f"over the {len(full)} of {len(timer.steps)} steps with >= 28 requests", flush=True)
    finally:
        timer.restore()
        await engine.close()
    return {
        "benchmark": "decode_breakdown", "quick": args.quick, "threads": args.threads, "waves": args.waves,
        "vs_bare_loop_pairs": [round(r, 3) for r in ratios], "vs_bare_loop_median": round(statistics.median(ratios), 3),
        "engine_share_of_wall": round(statistics.median(shares), 3),
        "mixed_tok_s": round(n_mix / t_mix, 1), "mixed_full_batch_tok_s": round(full_tok_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter sequences (under a minute on 2 cores)")
    parser.add_argument("--pairs", type=int, default=3, help="back-to-back lockstep pairs")
    parser.add_argument("--waves", type=int, default=None, help="mixed-workload waves (default 2 quick, 3 full)")
    parser.add_argument("--threads", type=int, default=max(1, min(4, (os.cpu_count() or 2) // 2)),
                        help="torch intra-op threads (default: half the cores, at most 4)")
    args = parser.parse_args()
    args.waves = args.waves or (2 if args.quick else 3)
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
