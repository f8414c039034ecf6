"""Runtime overhead per (request, node) invocation for a no-op node, vs a bare asyncio loop.

Each request is a DynamicLoop of ITERS calls of one no-op node on the function engine; with C
requests in flight, the micro-scheduler batches their calls. The baseline is the least a
hand-written asyncio server does for the same work: each request coroutine hands an item to a
batching task through a queue and awaits a future per call. Both run in this process, on one
event loop; the figure is wall time divided by the number of invocations.

    python benchmarks/core_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from mstar_core.graph import DynamicLoop, Graph, GraphNode, Walk
from mstar_core.model import LoadedModel
from mstar_core.plugins import discover
from mstar_core.runtime import AsyncEngine


def noop(x):
    return x


def build_model(inline: bool) -> LoadedModel:
    node = GraphNode("noop", inputs="x", outputs="x", engine="function", module=lambda: noop, options={"inline": inline})
    walk = Walk(name="w", body=DynamicLoop(body="noop", until=lambda env: False, max_iters="iters"), inputs=("x", "iters"))
    return LoadedModel("noop", Graph.build("noop", [node], [walk]))


async def run_mstar(registry, concurrency: int, iters: int, inline: bool) -> float:
    engine = AsyncEngine(registry, max_running=10_000)
    await engine.add_model(build_model(inline))
    await engine.generate("noop", {"x": 0, "iters": 10})  # warm up
    started = time.perf_counter()
    await asyncio.gather(*(engine.generate("noop", {"x": i, "iters": iters}) for i in range(concurrency)))
    elapsed = time.perf_counter() - started
    await engine.close()
    return elapsed / (concurrency * iters) * 1e6


async def run_bare(concurrency: int, iters: int) -> float:
    queue: list[tuple[int, asyncio.Future]] = []
    wake = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def batcher() -> None:
        nonlocal queue
        while True:
            await wake.wait()
            wake.clear()
            batch, queue = queue, []
            for x, fut in batch:
                fut.set_result(noop(x))

    async def request(x: int) -> None:
        for _ in range(iters):
            fut = loop.create_future()
            queue.append((x, fut))
            wake.set()
            x = await fut

    task = asyncio.ensure_future(batcher())
    started = time.perf_counter()
    await asyncio.gather(*(request(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - started
    task.cancel()
    return elapsed / (concurrency * iters) * 1e6


async def main(quick: bool) -> dict:
    iters = 200 if quick else 2000
    figures: dict[str, float] = {}
    registry = discover()
    for c in (1, 16, 64):
        bare = min([await run_bare(c, iters) for _ in range(3)])
        mstar = min([await run_mstar(registry, c, iters, inline=False) for _ in range(3)])
        mstar_inline = min([await run_mstar(registry, c, iters, inline=True) for _ in range(3)])
        figures[f"bare_us_c{c}"] = round(bare, 2)
        figures[f"mstar_us_c{c}"] = round(mstar, 2)
        figures[f"mstar_inline_us_c{c}"] = round(mstar_inline, 2)
        print(f"concurrency {c:3d}: M* {mstar:7.2f} us/inv (device thread), {mstar_inline:7.2f} us/inv (inline), "
              f"bare asyncio {bare:6.2f} us/inv", flush=True)
    figures["us_per_invocation"] = figures["mstar_us_c64"]
    figures["vs_bare_c64"] = round(figures["mstar_us_c64"] / figures["bare_us_c64"], 2)
    figures["target_us"] = 30
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (CI smoke run)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    print(json.dumps(asyncio.run(main(args.quick))))
