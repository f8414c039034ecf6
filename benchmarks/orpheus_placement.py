"""Tiny Orpheus colocated vs disaggregated (LM and SNAC codec in their own worker processes).

Same weights, same seeded requests, same run: time to first audio (median) at concurrency 1 and
LM tokens per second at concurrency C (the tiny SNAC emits only 16 samples per window, so
audio-seconds would say nothing). The disaggregated side pays for the control plane (ZeroMQ + wire
codec for every decode step) and gains a second process for the codec. Each side's CPU seconds per
1,000 tokens (this process and its workers) is printed too: on a busy machine the wall figures move
by +-10 % run to run, the CPU figures much less.

    python benchmarks/orpheus_placement.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from placement_shm import cpu_seconds

from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import load_placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.runtime import AsyncEngine

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "placement"


async def one(engine: AsyncEngine, seed: int, max_tokens: int) -> tuple[float, int]:
    started = time.perf_counter()
    first, tokens = None, 0
    async for out in engine.submit("orpheus", {"text": "The quick brown fox.", "voice": "tara", "seed": seed,
                                               "max_tokens": max_tokens, "ignore_eos": True}):
        if out.name == "audio":
            first = first or time.perf_counter() - started
        elif out.name == "next_token":
            tokens += 1
    return first or float("nan"), tokens


async def measure(placement_file: str, concurrency: int, requests: int, max_tokens: int) -> dict[str, float]:
    engine = placed_engine(discover())
    await engine.load_model("orpheus", LoadOptions(preset="tiny"), placement=load_placement(EXAMPLES / placement_file))
    try:
        await one(engine, 0, max_tokens)  # warm up
        ttfa = [(await one(engine, seed, max_tokens))[0] for seed in range(1, 6)]
        sem = asyncio.Semaphore(concurrency)

        async def limited(seed: int) -> tuple[float, int]:
            async with sem:
                return await one(engine, seed, max_tokens)

        started, cpu_before = time.perf_counter(), cpu_seconds(engine)
        results = await asyncio.gather(*(limited(100 + i) for i in range(requests)))
        wall, cpu = time.perf_counter() - started, cpu_seconds(engine) - cpu_before
        tokens = sum(n for _, n in results)
        return {"ttfa_ms_c1": statistics.median(ttfa) * 1e3, "tokens_per_s": tokens / wall,
                "cpu_s_per_1k_tokens": cpu / tokens * 1e3}
    finally:
        await engine.close()


async def main(quick: bool, requests: int | None = None, max_tokens: int | None = None) -> dict[str, float]:
    concurrency = 8
    default_requests, default_tokens = (16, 150) if quick else (64, 400)
    requests, max_tokens = requests or default_requests, max_tokens or default_tokens
    colocated = await measure("orpheus-colocated.yaml", concurrency, requests, max_tokens)
    split = await measure("orpheus-disaggregated.yaml", concurrency, requests, max_tokens)
    for name, fig in (("colocated", colocated), ("disaggregated", split)):
        print(f"{name:14s} TTFA(c=1) {fig['ttfa_ms_c1']:7.1f} ms   throughput(c={concurrency}) "
              f"{fig['tokens_per_s']:6.1f} tokens/s   CPU {fig['cpu_s_per_1k_tokens']:.3f} s per 1k tokens", flush=True)
    return {
        "colocated_ttfa_ms": round(colocated["ttfa_ms_c1"], 1),
        "disaggregated_ttfa_ms": round(split["ttfa_ms_c1"], 1),
        "colocated_tokens_per_s": round(colocated["tokens_per_s"], 1),
        "disaggregated_tokens_per_s": round(split["tokens_per_s"], 1),
        "ttfa_ratio_split_over_colocated": round(split["ttfa_ms_c1"] / colocated["ttfa_ms_c1"], 2),
        "colocated_cpu_s_per_1k_tokens": round(colocated["cpu_s_per_1k_tokens"], 3),
        "disaggregated_cpu_s_per_1k_tokens": round(split["cpu_s_per_1k_tokens"], 3),
        "throughput_ratio_split_over_colocated": round(split["tokens_per_s"] / colocated["tokens_per_s"], 2),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
    parser.add_argument("--requests", type=int, help="requests in the throughput run (default 16 quick, 64 full)")
    parser.add_argument("--max-tokens", type=int, help="tokens per request (default 150 quick, 400 full)")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.quick, args.requests, args.max_tokens))))
