"""`run_on_device`: a step handed to the device thread and its result (or exception) handed back to the loop, as
`run_in_executor` hands them, with one `call_soon_threadsafe` instead of chained futures."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from mstar_core.graph import GraphNode
from mstar_core.runtime.engine import EngineContext, Invocation
from mstar_core.runtime.scheduler import NodeScheduler, run_on_device
from tests.core.helpers import Queued


async def test_the_result_comes_back_from_the_executors_thread():
    device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dev")
    try:
        name = await run_on_device(asyncio.get_running_loop(), device, lambda: threading.current_thread().name)
        assert name.startswith("dev")
    finally:
        device.shutdown()


async def test_an_exception_reaches_the_awaiting_task():
    device = ThreadPoolExecutor(max_workers=1)

    def broken():
        raise ValueError("step broke")

    try:
        with pytest.raises(ValueError, match="step broke"):
            await run_on_device(asyncio.get_running_loop(), device, broken)
    finally:
        device.shutdown()


async def test_a_cancelled_wait_drops_the_result_and_the_thread_goes_on():
    device = ThreadPoolExecutor(max_workers=1)
    started, release = threading.Event(), threading.Event()

    def slow():
        started.set()
        release.wait(5)
        return "late"

    loop = asyncio.get_running_loop()
    try:
        future = run_on_device(loop, device, slow)
        await loop.run_in_executor(None, started.wait, 5)
        future.cancel()
        release.set()
        # the thread finishes its call; the next one runs after it, and the cancelled future stays cancelled
        assert await run_on_device(loop, device, lambda: "next") == "next"
        assert future.cancelled()
    finally:
        device.shutdown()


def test_a_loop_closed_while_the_step_runs_is_not_an_error():
    device = ThreadPoolExecutor(max_workers=1)
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def step():
        started.set()
        release.wait(5)
        return 1

    loop = asyncio.new_event_loop()
    future = run_on_device(loop, device, step)
    started.wait(5)
    loop.close()
    release.set()
    device.submit(finished.set).result(5)  # (after the step's call: its hand-back already ran and raised nothing)
    device.shutdown()
    assert finished.is_set() and not future.done()


class Doubler(Queued):
    """Answers `2x` for every call, recording the thread each step ran on."""

    kind = "doubler"

    def __init__(self):
        super().__init__(GraphNode("d", inputs="x", outputs="y", engine="doubler"), None, EngineContext("t", "cpu", {}))
        self.threads: set[str] = set()

    def step(self):
        self.threads.add(threading.current_thread().name)
        return [(inv, {"y": 2 * inv.inputs["x"]}) for inv in self.take()]


async def test_the_scheduler_steps_on_the_device_thread():
    device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dev")
    engine = Doubler()
    scheduler = NodeScheduler(engine, device)
    try:
        results = await asyncio.wait_for(asyncio.gather(*(scheduler.submit(Invocation(f"r{i}", "d", {"x": i}, {}))
                                                          for i in range(3))), 5)
        assert results == [{"y": 0}, {"y": 2}, {"y": 4}]
        assert engine.threads and all(name.startswith("dev") for name in engine.threads)
    finally:
        await scheduler.close()
        device.shutdown()


async def test_a_call_cancelled_before_the_thread_reaches_it_does_not_run():
    device = ThreadPoolExecutor(max_workers=1)
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []
    loop = asyncio.get_running_loop()
    try:
        first = run_on_device(loop, device, lambda: (started.set(), release.wait(5)))
        queued = run_on_device(loop, device, lambda: ran.append("queued"))
        await loop.run_in_executor(None, started.wait, 5)
        queued.cancel()
        release.set()
        await first
        assert await run_on_device(loop, device, lambda: "after") == "after"
        assert ran == [] and queued.cancelled()
    finally:
        device.shutdown()
