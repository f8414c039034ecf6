"""Backpressure: a request whose reader lags runs at most MAX_UNREAD outputs ahead of it, then waits (a credit);
a request nobody iterates (only `result()`) is never held back; a slow HTTP client holds its request back too."""

from __future__ import annotations

import asyncio

from mstar_core.graph import DynamicLoop, Graph, GraphNode, NodeCall, Walk
from mstar_core.model import LoadedModel
from mstar_core.runtime import AsyncEngine
from mstar_core.runtime.request import MAX_UNREAD

STEPS = 5 * MAX_UNREAD


def _chunk(loop_index, n):
    return {"chunk": loop_index, "done": loop_index + 1 >= n}


def _model() -> LoadedModel:
    graph = Graph.build(
        "ticker",
        [GraphNode("tick", inputs=("loop_index", "n"), outputs=("chunk", "done"), engine="function",
                   module=lambda: _chunk)],
        [Walk(name="run", body=DynamicLoop(body=NodeCall("tick"), until=lambda env: env["done"], max_iters="n"),
              inputs=("n",), emit=("chunk",))],
    )
    return LoadedModel(name="ticker", graph=graph)


async def _read_slowly() -> tuple[int, list[int]]:
    async with AsyncEngine() as engine:
        await engine.add_model(_model())
        handle = engine.submit("ticker", {"n": STEPS})
        seen = [(await handle.__anext__()).value]
        await asyncio.sleep(0.5)  # the producer could finish all STEPS in this time
        backlog = len(handle._items)
        async for out in handle:
            seen.append(out.value)
        await handle.result()
        return backlog, seen


def test_a_lagging_reader_holds_the_producer_to_its_credit():
    backlog, seen = asyncio.run(_read_slowly())
    assert backlog <= MAX_UNREAD, backlog  # before: every one of the STEPS outputs sat unread
    assert seen == list(range(STEPS))  # nothing lost or reordered by waiting


def test_a_request_that_is_not_read_is_not_held_back():
    async def main():
        async with AsyncEngine() as engine:
            await engine.add_model(_model())
            handle = engine.submit("ticker", {"n": STEPS})
            await asyncio.wait_for(handle.result(), 30)
            return len(handle._items)

    assert asyncio.run(main()) == STEPS + 1  # every output (and the end marker) buffered: no reader, no credit
