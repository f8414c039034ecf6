"""`launcher: ray`: a worker placed as an actor on a local Ray head (loopback), supervised like any other."""

import asyncio
import time

import pytest

from mstar_core.cluster.cluster import WorkerLost
from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import Placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def ray_head():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    yield
    ray.shutdown()


async def tokens(engine, start, stop):
    handle = engine.submit("fixture-stream", {"start": start, "stop": stop})
    return [out.value async for out in handle if out.name == "token"]


async def test_a_ray_actor_worker_serves_and_is_restarted_when_it_dies(ray_head):
    placement = Placement.from_dict(
        {
            "workers": {"gen": {"launcher": "ray", "num_cpus": 1}},
            "nodes": {"gen": "gen"},
            "engine_settings": {"gen": {"step_delay": 0.02}},
            "control": {"heartbeat_interval": 0.2},
        }
    )
    engine = placed_engine(discover())
    try:
        await engine.load_model("fixture-stream", LoadOptions(preset="tiny"), placement=placement)
        state = engine.cluster.workers["gen"]
        assert state.process.poll() is None and state.process.pid != 0
        assert engine.cluster.tcp_address().startswith("tcp://127.0.0.1:")  # actors join over loopback TCP
        assert await tokens(engine, 1, 6) == [1, 2, 3, 4, 5, 6]
        assert ray.available_resources().get("CPU", 0) <= 1  # the actor holds the CPU it asked for

        long = engine.submit("fixture-stream", {"start": 0, "stop": 10_000})
        await asyncio.sleep(0.3)
        killed_at = time.monotonic()
        first_pid = state.process.pid
        engine.cluster.kill("gen")
        with pytest.raises(WorkerLost, match="worker 'gen' exited"):
            await long.result()
        assert time.monotonic() - killed_at < 2.0
        deadline = time.monotonic() + 60
        while not state.ready and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert state.restarts == 1 and state.process.pid != first_pid
        assert await tokens(engine, 3, 5) == [3, 4, 5]  # the new actor serves
        await engine.close()
        assert state.process.wait(10) == 0  # the actor's worker left cleanly when the server shut down
    finally:
        await engine.close()
