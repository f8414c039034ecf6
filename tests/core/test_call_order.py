"""The node setting `call_order="fifo"`: calls served in submission order, stream priority and request age ignored.

Timing-free: engines that record what each step ran; the same submissions under the default order
("urgency") show that the order asserted is the setting's doing.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from mstar_core.cluster.strategy import placed_engine
from mstar_core.errors import ConfigError
from mstar_core.graph import Graph, GraphNode, Walk
from mstar_core.model import LoadedModel
from mstar_core.runtime import AsyncEngine
from mstar_core.runtime.engine import Invocation, call_order
from mstar_core.runtime.scheduler import NodeScheduler
from tests.core.helpers import Recording
from tests.engines.paged_tiny import LM_NODE, TinyNode, engine_for


def _inv(rid: str, arrival: float, priority: float = 0.0, index: int = 0, node: str = "n") -> Invocation:
    return Invocation(rid, node, {}, {}, index, priority, arrival)


async def _served(order: str) -> list[str]:
    engine = Recording(max_batch_size=2)
    engine.call_order = order
    sched = NodeScheduler(engine, None)
    # submitted youngest first, and the youngest's stream is about to run dry: "urgency" would reorder all of it
    subs = (("d", 4.0, 0.0), ("c", 3.0, 0.0), ("b", 2.0, 0.0), ("a", 1.0, 0.0), ("urgent", 9.0, 0.5))
    await asyncio.gather(*(sched.submit(_inv(rid, arrival, priority)) for rid, arrival, priority in subs))
    await sched.close()
    return engine.order


async def test_fifo_serves_calls_in_submission_order_where_urgency_reorders_them():
    assert await _served("fifo") == ["d", "c", "b", "a", "urgent"]
    assert await _served("urgency") == ["urgent", "a", "b", "c", "d"]


async def _looping(order: str) -> list[str]:
    """Three requests of three calls each (a loop: the next call after the last one's answer), one call a step."""
    engine = Recording(max_batch_size=1)
    engine.call_order = order
    sched = NodeScheduler(engine, None)

    async def request(rid: str, arrival: float) -> None:
        for i in range(3):
            await sched.submit(_inv(rid, arrival, index=i))

    await asyncio.gather(*(request(rid, a) for rid, a in (("a", 1.0), ("b", 2.0), ("c", 3.0))))
    await sched.close()
    return engine.order


async def test_fifo_takes_turns_between_looping_requests_where_urgency_finishes_the_oldest_first():
    assert await _looping("fifo") == ["a", "b", "c"] * 3  # each call queues behind those submitted before it
    assert await _looping("urgency") == ["a"] * 3 + ["b"] * 3 + ["c"] * 3


async def test_fifo_admits_requests_by_their_first_call_and_leaves_the_callers_invocation_alone():
    engine = Recording(max_batch_size=64, max_active=1)
    engine.call_order = "fifo"
    sched = NodeScheduler(engine, None)
    young, old = _inv("young", 5.0, priority=2.0), _inv("old", 1.0)
    first, second = sched.submit(young), sched.submit(old)
    await first
    assert not second.done()  # "young" was submitted first: it holds the one place, though "old" is older
    sched.release("young")
    await second
    assert engine.order == ["young", "old"]
    assert (young.priority, young.arrival) == (2.0, 5.0)  # the stamp is on the node's copy
    await sched.close()


async def _kv_decodes(order: str) -> list[str]:
    """Three prefilled sequences (arrivals a < b < c), one row a step; their decodes submitted in the order c, a, b."""
    engine = engine_for(TinyNode(seed=1), LM_NODE, max_num_seqs=1, max_batch_size=8)
    engine.call_order = order
    sched = NodeScheduler(engine, None)
    arrivals = {"a": 1.0, "b": 2.0, "c": 3.0}
    await asyncio.gather(*(sched.submit(Invocation(r, "lm", {"input_ids": [1, 2, 3]}, {}, 0, 0.0, t))
                           for r, t in arrivals.items()))
    served: list[str] = []

    async def decode(rid: str) -> None:
        await sched.submit(Invocation(rid, "lm", {"input_ids": [4]}, {}, 1, 0.0, arrivals[rid]))
        served.append(rid)

    await asyncio.gather(*(decode(r) for r in ("c", "a", "b")))  # all three reach the engine before its next step
    assert engine.largest_batch == 1
    await sched.close()
    return served


async def test_kvcache_engine_follows_the_submission_order_not_its_sequences_ages():
    assert await _kv_decodes("fifo") == ["c", "a", "b"]
    assert await _kv_decodes("urgency") == ["a", "b", "c"]


def test_call_order_setting_is_checked():
    assert call_order("n", None) == "urgency"
    assert call_order("n", "fifo") == "fifo" and call_order("n", "urgency") == "urgency"
    for bad in ("FIFO", "lifo", 1, True, ["fifo"]):
        with pytest.raises(ConfigError, match="call_order"):
            call_order("n", bad)


def _loaded() -> LoadedModel:
    node = GraphNode("n", inputs="x", outputs="y", engine="function", module=lambda: lambda x: x * 2)
    return LoadedModel("m", Graph.build("m", [node], [Walk(name="w", body="n", inputs="x", outputs="y")]))


async def test_async_engine_reads_the_setting_and_refuses_a_bad_one():
    engine = AsyncEngine()
    try:
        await engine.add_model(_loaded(), settings={"n": {"call_order": "fifo"}}, alias="fifo")
        await engine.add_model(_loaded(), alias="default")
        assert engine.node_engines("fifo")["n"].call_order == "fifo"
        assert engine.node_engines("default")["n"].call_order == "urgency"
        with pytest.raises(ConfigError, match="call_order"):
            await engine.add_model(_loaded(), settings={"n": {"call_order": "random"}}, alias="bad")
        assert torch.equal((await engine.submit("fifo", {"x": torch.ones(2)}).result())["y"], 2 * torch.ones(2))
    finally:
        await engine.close()


@pytest.mark.timeout(120)
async def test_a_worker_node_with_fifo_admits_the_request_sent_first_not_the_older_one():
    """The setting travels with a placement: the worker's `gen` (one request at a time) takes calls as sent."""
    from mstar_core.config import Placement
    from mstar_core.model import LoadOptions
    from mstar_core.plugins import discover

    placement = {"workers": {"gen": {}}, "nodes": {"gen": "gen"},
                 "engine_settings": {"gen": {"max_active_requests": 1, "call_order": "fifo"}}}
    engine = placed_engine(discover())
    await engine.load_model("fixture-stream", LoadOptions(preset="tiny"), placement=Placement.from_dict(placement))
    try:
        cluster = engine.cluster

        def call(rid: str, arrival: float) -> Invocation:
            return Invocation(rid, "gen", {"start": 0}, {}, 0, 0.0, arrival)

        await asyncio.wait_for(cluster.invoke("gen", "fixture-stream", call("hold", 1.0)), 60)
        young = cluster.invoke("gen", "fixture-stream", call("young", 30.0))  # sent first: by age it would wait
        old = cluster.invoke("gen", "fixture-stream", call("old", 20.0))
        cluster.release("gen", "hold")
        done, _ = await asyncio.wait((young, old), timeout=60, return_when=asyncio.FIRST_COMPLETED)
        assert done == {young} and not old.done()
        cluster.release("gen", "young")
        assert (await asyncio.wait_for(old, 60))["token"] == 0
    finally:
        await engine.close()
