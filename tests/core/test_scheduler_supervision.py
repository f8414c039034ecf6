"""The node scheduler never dies silently: a failing `add` fails one invocation, a crashed loop is restarted."""

from __future__ import annotations

import asyncio
import logging

from mstar_core.errors import NodeExecutionError, RequestError
from mstar_core.graph import GraphNode
from mstar_core.runtime.engine import EngineContext, Invocation
from mstar_core.runtime.scheduler import NodeScheduler
from tests.core.helpers import Queued, Recording


class PlusOne(Queued):
    """Answers `x + 1`; `add` refuses the inputs the test marks as poison, as a real engine's parsing would."""

    kind = "plus_one"

    def __init__(self):
        super().__init__(GraphNode("plus", inputs="x", outputs="y", engine="plus_one"), None, EngineContext("t", "cpu", {}))
        self.released: list[str] = []

    def add(self, invocation):
        x = invocation.inputs["x"]
        if x == "reject":
            raise RequestError("x must be a number", status=400)
        if x == "crash":
            raise ZeroDivisionError("engine bug on this input")
        super().add(invocation)

    def step(self):
        return [(inv, {"y": inv.inputs["x"] + 1}) for inv in self.take()]

    def release(self, request_id):
        self.released.append(request_id)
        super().release(request_id)


def _submit(sched: NodeScheduler, rid: str, x) -> asyncio.Future:
    return sched.submit(Invocation(rid, "plus", {"x": x}, {}))


async def _settle(futures, timeout=5.0):
    return await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), timeout)


async def test_an_add_that_raises_fails_only_its_invocation():
    sched = NodeScheduler(PlusOne(), None)
    futures = [_submit(sched, "a", 1), _submit(sched, "bad", "crash"), _submit(sched, "rej", "reject"), _submit(sched, "b", 2)]
    a, crash, reject, b = await _settle(futures)
    assert a == {"y": 2} and b == {"y": 3}
    assert isinstance(crash, NodeExecutionError) and isinstance(crash.cause, ZeroDivisionError) and crash.status == 500
    assert isinstance(reject, NodeExecutionError) and reject.status == 400 and "x must be a number" in str(reject)
    assert await _settle([_submit(sched, "c", 5)]) == [{"y": 6}]
    await sched.close()


async def test_a_crashed_loop_is_logged_restarted_and_fails_what_was_in_flight(caplog, monkeypatch):
    engine = PlusOne()
    sched = NodeScheduler(engine, None)
    calls = {"n": 0}
    real = engine.has_work

    def flaky():  # the loop's own bookkeeping breaks once, with two invocations already handed to the engine
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("bookkeeping bug")
        return real()

    monkeypatch.setattr(engine, "has_work", flaky)
    with caplog.at_level(logging.ERROR, logger="mstar.scheduler"):
        first = await _settle([_submit(sched, "a", 1), _submit(sched, "b", 2)])
    assert all(isinstance(r, NodeExecutionError) and "bookkeeping bug" in str(r) for r in first)
    assert {"a", "b"} <= set(engine.released)  # the engine forgets what it can no longer answer
    assert any("plus" in r.getMessage() and r.exc_info for r in caplog.records), caplog.text
    # the loop is running again by itself: the next call is answered without a restart from submit()
    task = sched._task
    assert await _settle([_submit(sched, "c", 5)]) == [{"y": 6}]
    assert sched._task is task and not task.done()
    await sched.close()


async def test_work_queued_during_a_crash_is_served_after_the_restart(monkeypatch):
    engine = PlusOne()
    sched = NodeScheduler(engine, None)
    real_step = engine.step
    state = {"crashed": False}

    def step_then_crash():
        results = real_step()
        if not state["crashed"]:
            state["crashed"] = True
            return None  # not a list: the loop's bookkeeping of the results raises
        return results

    monkeypatch.setattr(engine, "step", step_then_crash)
    first = _submit(sched, "a", 1)
    await asyncio.sleep(0)  # 'a' is in flight when the loop breaks; 'b' arrives while it restarts
    second = _submit(sched, "b", 2)
    a, b = await _settle([first, second])
    assert isinstance(a, NodeExecutionError)
    assert b == {"y": 3}
    await sched.close()


async def test_a_loop_that_keeps_crashing_backs_off_instead_of_spinning(monkeypatch):
    engine = PlusOne()
    sched = NodeScheduler(engine, None)
    crashes = {"n": 0}

    def broken():
        crashes["n"] += 1
        raise RuntimeError("always broken")

    monkeypatch.setattr(engine, "has_work", broken)
    results = await _settle([_submit(sched, "a", 1)])
    assert isinstance(results[0], NodeExecutionError)
    await asyncio.sleep(0.3)
    assert crashes["n"] < 50  # restarted, but not in a tight loop
    await sched.close()


async def test_the_scheduler_holds_at_most_max_batch_size_in_the_engine_most_urgent_first():
    engine = Recording(max_batch_size=3)
    sched = NodeScheduler(engine, None)
    futures = [sched.submit(Invocation(f"r{i}", "n", {}, {}, priority=float(i % 4))) for i in range(10)]
    await asyncio.gather(*futures)
    assert engine.most == 3  # never more in the engine than it says it can hold
    assert engine.order[:3] == ["r3", "r7", "r2"]  # the most urgent first, first come first served among equals
    await sched.close()


async def test_a_chore_between_steps_sees_the_releases_asked_for_before_it():
    """Unloading an adapter right after cancelling its request must find the request gone, not a 409 race."""
    from concurrent.futures import ThreadPoolExecutor

    engine = PlusOne()
    engine.inline = False
    with ThreadPoolExecutor(1) as executor:
        sched = NodeScheduler(engine, executor)
        assert await _settle([_submit(sched, "a", 1)]) == [{"y": 2}]  # the loop runs
        sched.release("gone")
        seen = await sched.between_steps(lambda: list(engine.released))
        assert "gone" in seen
        boom = sched.between_steps(lambda: 1 / 0)
        assert isinstance((await _settle([boom]))[0], ZeroDivisionError)  # a failing chore fails its caller alone
        assert await _settle([_submit(sched, "b", 2)]) == [{"y": 3}]
        await sched.close()
