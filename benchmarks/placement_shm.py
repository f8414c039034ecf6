"""Tensor-heavy placement: one node returning `x + 1` for a 16 MiB tensor, colocated vs zmq vs shm worker.

Every request sends a 16 MiB float32 tensor to the node and gets 16 MiB back, so a worker placement
moves 32 MiB per request across the process boundary. Colocated (the node in the serving process)
is the baseline; `zmq` sends the frames over the worker's control socket (IPC), `shm` moves them
through the shared-memory arena (one copy in, zero-copy receive). Same run, same tensors.

    python benchmarks/placement_shm.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import torch

from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import Placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.runtime import AsyncEngine

MIB = 1 << 20


def cpu_seconds(engine: AsyncEngine) -> float:
    """CPU time used so far by this process and its worker processes (robust to a busy machine)."""
    total = time.process_time()
    for state in (engine.cluster.workers.values() if engine.cluster else ()):
        with open(f"/proc/{state.process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def placement(kind: str) -> Placement | None:
    if kind == "colocated":
        return None
    return Placement.from_dict({"workers": {"w": {"transport": kind}}, "nodes": {"bump": "w"}})


async def measure(kind: str, x: torch.Tensor, requests: int, concurrency: int) -> dict[str, float]:
    engine = placed_engine(discover())
    await engine.load_model("fixture-blob", LoadOptions(), placement=placement(kind))
    try:
        expected = x + 1

        async def one() -> float:
            started = time.perf_counter()
            y = (await engine.submit("fixture-blob", {"x": x}).result())["y"]
            took = time.perf_counter() - started
            assert torch.equal(y, expected), f"{kind}: wrong result"
            return took

        for _ in range(3):
            await one()  # warm up (arena segments, mappings, allocator)
        cpu_before = cpu_seconds(engine)
        latency = [await one() for _ in range(requests)]
        cpu = (cpu_seconds(engine) - cpu_before) / requests
        sem = asyncio.Semaphore(concurrency)

        async def limited() -> float:
            async with sem:
                return await one()

        started = time.perf_counter()
        await asyncio.gather(*(limited() for _ in range(requests)))
        wall = time.perf_counter() - started
        moved = 2 * x.numel() * x.element_size() if kind != "colocated" else 0
        return {
            "ms_p50": statistics.median(latency) * 1e3,
            "ms_min": min(latency) * 1e3,
            "cpu_ms_per_req": cpu * 1e3,
            "req_per_s": requests / wall,
            "gb_per_s_moved": moved * requests / wall / 1e9,
        }
    finally:
        await engine.close()


async def main(quick: bool, mib: int) -> dict[str, object]:
    x = torch.randn(mib * MIB // 4)
    requests = 15 if quick else 60
    results = {kind: await measure(kind, x, requests, 4) for kind in ("colocated", "zmq", "shm")}
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith(f"mstar-shm-{os.getpid()}-")]
    return {
        "tensor_mib": mib,
        "requests": requests,
        **{f"{k}_{m}": round(v, 3) for k, r in results.items() for m, v in r.items()},
        "shm_vs_zmq_latency": round(results["zmq"]["ms_p50"] / results["shm"]["ms_p50"], 2),
        "shm_vs_zmq_cpu": round(results["zmq"]["cpu_ms_per_req"] / results["shm"]["cpu_ms_per_req"], 2),
        "shm_overhead_vs_colocated_ms": round(results["shm"]["ms_p50"] - results["colocated"]["ms_p50"], 2),
        "zmq_overhead_vs_colocated_ms": round(results["zmq"]["ms_p50"] - results["colocated"]["ms_p50"], 2),
        "shm_segments_left": len(leftovers),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (< 60 s)")
    parser.add_argument("--mib", type=int, default=16, help="tensor size in MiB")
    args = parser.parse_args()
    # one compute thread everywhere: waking torch's thread pool on a busy machine costs milliseconds
    # and would drown the transport differences this measures
    torch.set_num_threads(1)
    os.environ["MSTAR_WORKER_THREADS"] = "1"
    print(json.dumps(asyncio.run(main(args.quick, args.mib))))
