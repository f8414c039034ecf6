"""Older requests first where a step cannot take everyone, and `max_active_requests` admits oldest first; none starves.

Timing-free: engines that record what each step ran, invocations stamped with made-up arrivals.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from mstar_diffusion.engine import DiffusionEngine
from mstar_kvcache.blocks import BlockManager
from mstar_kvcache.pool import PagePool
from mstar_kvcache.scheduler import Scheduler
from mstar_kvcache.sequence import Sequence

from mstar_core.errors import ConfigError
from mstar_core.graph import GraphNode
from mstar_core.runtime.engine import EngineContext, Invocation, active_limit
from mstar_core.runtime.scheduler import NodeScheduler
from tests.core.helpers import Recording


def _inv(rid: str, arrival: float, priority: float = 0.0, index: int = 0) -> Invocation:
    return Invocation(rid, "n", {}, {}, index, priority, arrival)


async def test_a_full_step_takes_the_oldest_requests_and_a_stream_running_dry_still_wins():
    engine = Recording(max_batch_size=2)
    sched = NodeScheduler(engine, None)
    # submitted youngest first; 'urgent' is the youngest but its stream is about to run dry
    futures = [sched.submit(_inv(rid, arrival)) for rid, arrival in (("d", 4.0), ("c", 3.0), ("b", 2.0), ("a", 1.0))]
    futures.append(sched.submit(_inv("urgent", 9.0, priority=0.5)))
    await asyncio.gather(*futures)
    assert engine.order == ["urgent", "a", "b", "c", "d"]
    await sched.close()


async def test_max_active_requests_admits_the_oldest_and_each_finishes_before_later_ones_start():
    """Four requests of three calls each, one admitted at a time: whole requests in arrival order, none starved."""
    engine = Recording(max_batch_size=64, max_active=1)
    sched = NodeScheduler(engine, None)
    finished: list[str] = []

    async def request(rid: str, arrival: float) -> None:
        for i in range(3):  # a loop: each call goes back to the node after the last one's answer
            await sched.submit(_inv(rid, arrival, index=i))
        finished.append(rid)
        sched.release(rid)  # what the conductor does when the request ends

    arrivals = {"r2": 2.0, "r0": 0.0, "r3": 3.0, "r1": 1.0}
    await asyncio.gather(*(request(rid, a) for rid, a in arrivals.items()))  # started youngest-ish first
    assert finished == ["r0", "r1", "r2", "r3"]
    assert engine.order == [r for r in ("r0", "r1", "r2", "r3") for _ in range(3)]  # never two requests in a step
    await sched.close()


async def test_two_admitted_requests_batch_and_a_cancelled_one_frees_its_place():
    engine = Recording(max_batch_size=64, max_active=2)
    sched = NodeScheduler(engine, None)
    first = [sched.submit(_inv(rid, a)) for rid, a in (("c", 3.0), ("b", 2.0), ("a", 1.0))]
    await asyncio.gather(first[1], first[2])
    assert engine.order == ["a", "b"]  # one step, the two oldest; 'c' waits for a place
    assert not first[0].done()
    sched.release("a")  # cancelled (or finished): its place goes to the oldest waiting request
    await first[0]
    assert engine.order == ["a", "b", "c"]
    await sched.close()


async def test_an_admitted_request_keeps_its_place_until_released():
    """Admission is not pre-emptive: an older request arriving later waits for the place, then goes first."""
    engine = Recording(max_batch_size=64, max_active=1)
    sched = NodeScheduler(engine, None)
    await sched.submit(_inv("young", 5.0))
    old = sched.submit(_inv("old", 1.0))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not old.done()
    again = sched.submit(_inv("young", 5.0, index=1))
    await again  # still 'young''s place
    assert not old.done()
    sched.release("young")
    await old
    assert engine.order == ["young", "young", "old"]
    await sched.close()


def test_active_limit_setting_is_checked():
    assert active_limit("n", None) is None and active_limit("n", 3) == 3
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ConfigError, match="max_active_requests"):
            active_limit("n", bad)


def _kv_seq(rid: str, order: int, arrival: float, priority: float = 0.0) -> Sequence:
    seq = Sequence(rid, "main", tokens=[1, 2, 3], order=order, arrival=arrival, priority=priority)
    seq.pending = object()
    return seq


def test_kvcache_budget_takes_the_oldest_request_then_priority_still_first():
    pool = PagePool(32, 4, num_layers=1, num_kv_heads=1, head_dim=2)
    sched = Scheduler(BlockManager(pool), max_num_seqs=2, max_num_batched_tokens=64)
    # the later calls of an older request (higher order: made after the others) keep their request's place
    seqs = [_kv_seq("young", 0, 5.0), _kv_seq("mid", 1, 3.0), _kv_seq("old", 2, 1.0)]
    assert [s.request_id for s, _ in sched.schedule(seqs, lambda: seqs).work] == ["old", "mid"]
    seqs = [_kv_seq("young", 0, 5.0, priority=1.0), _kv_seq("mid", 1, 3.0), _kv_seq("old", 2, 1.0)]
    assert [s.request_id for s, _ in sched.schedule(seqs, lambda: seqs).work] == ["young", "old"]


def test_diffusion_batch_takes_the_oldest_requests():
    node = GraphNode("euler", inputs=("latents", "step", "num_steps", "velocity"),
                     outputs=("latents", "timestep", "sigma"), engine="diffusion",
                     options={"schedule": "flow_euler", "latent_shape": (None, 4)})
    engine = DiffusionEngine(node, None, EngineContext("w", torch.device("cpu"), {"max_batch_size": 2}))
    for rid, arrival in (("c", 3.0), ("b", 2.0), ("a", 1.0)):
        inputs = {"latents": torch.zeros(2, 4), "step": 0, "num_steps": 4, "velocity": torch.ones(2, 4)}
        engine.add(Invocation(rid, "euler", inputs, node.options, 0, 0.0, arrival))
    assert [inv.request_id for inv, out in engine.step()] == ["a", "b"]
    assert [inv.request_id for inv, out in engine.step()] == ["c"]  # the youngest is next, not dropped


async def test_a_state_move_between_schedulers_carries_the_request_arrival():
    # a per-walk node's state moving to another scheduler must not look like the oldest request there
    from mstar_core.runtime.conductor import Conductor, RequestState

    class Holder:
        def __init__(self):
            self.seen: list[Invocation] = []

        async def submit(self, inv: Invocation):
            self.seen.append(inv)
            return {"state": "s"}

    state = RequestState("r", emit=lambda out: None)
    held, target = Holder(), Holder()
    await Conductor._move(Conductor.__new__(Conductor), state, "n", held, target)
    assert [i.options["transfer"] for i in held.seen + target.seen] == ["export", "import"]
    assert {i.arrival for i in held.seen + target.seen} == {state.arrival} and state.arrival > 0


async def test_max_active_requests_admits_live_requests_before_older_background_ones():
    from mstar_core.runtime.engine import BACKGROUND_PRIORITY

    engine = Recording(max_batch_size=64, max_active=1)
    sched = NodeScheduler(engine, None)
    futures = [sched.submit(_inv("batch", 0.0, priority=BACKGROUND_PRIORITY)), sched.submit(_inv("live", 5.0))]
    await futures[1]
    sched.release("live")
    await futures[0]
    assert engine.order == ["live", "batch"]  # the background request, though older, waited
    await sched.close()


async def test_a_request_priority_reaches_every_call_under_its_stream_priority():
    """`AsyncEngine.submit(priority=...)` is the request's class: each of its node calls carries it."""
    from mstar_core.runtime import AsyncEngine
    from mstar_core.runtime.engine import BACKGROUND_PRIORITY
    from mstar_core.runtime.scheduler import NodeScheduler as Real

    seen: list[float] = []
    original = Real.submit

    def spy(self, invocation):
        seen.append(invocation.priority)
        return original(self, invocation)

    from mstar_core.model import LoadOptions
    from mstar_core.plugins.manager import discover

    engine = AsyncEngine(discover())
    await engine.load_model("fixture-echo", LoadOptions(preset="tiny"))
    try:
        Real.submit = spy
        await engine.generate("fixture-echo", {"x": 1}, priority=BACKGROUND_PRIORITY)
        assert seen and all(p == BACKGROUND_PRIORITY for p in seen)
        seen.clear()
        await engine.generate("fixture-echo", {"x": 1})
        assert seen and all(p == 0.0 for p in seen)
    finally:
        Real.submit = original
        await engine.close()
