"""The HTTP path prepares requests off the event loop (a slow upload does not stall other streams), and `mstar
serve`'s engine splits the cores with the workers it spawns, as the serving process did before the engine stopped
doing so by default for embedders."""

from __future__ import annotations

import asyncio
import threading
import time

import attrs

from mstar_core.api.requests.submit import submit
from mstar_core.api.server.app import ServerConfig
from mstar_core.api.server.launch import serving_engine
from mstar_core.graph import Graph, GraphNode, Walk
from mstar_core.model import LoadedModel
from mstar_core.plugins.manager import discover
from mstar_core.runtime import AsyncEngine


@attrs.define
class _State:
    engine: AsyncEngine
    config: ServerConfig = attrs.field(factory=ServerConfig)
    draining: bool = False
    inflight: int = 0

    def track(self, handle) -> None:
        pass


async def test_a_slow_prepare_leaves_the_event_loop_running():
    release = threading.Event()

    def slow_prepare(inputs):
        release.wait(5)  # what decoding a large upload costs, without the CPU
        return dict(inputs)

    graph = Graph.build("slow", [GraphNode("f", inputs="x", outputs="y", engine="function", module=lambda: lambda x: x)],
                        [Walk(name="w", body="f", inputs="x", outputs="y")])
    async with AsyncEngine() as engine:
        await engine.add_model(LoadedModel("slow", graph, prepare=slow_prepare))
        pending = asyncio.ensure_future(submit(_State(engine), "slow", {"x": 1}))
        start = time.monotonic()
        for _ in range(10):  # other requests' streams keep flowing meanwhile
            await asyncio.sleep(0.01)
        assert time.monotonic() - start < 1.0 and not pending.done()
        release.set()
        handle = await pending
        assert (await handle.result())["y"] == 1 and handle.prepared == {"x": 1}


def test_serve_shares_torch_threads_with_spawned_workers():
    assert serving_engine(discover(), ServerConfig()).torch_threads == "share"
