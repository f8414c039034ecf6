"""Nodes sharing one device thread take turns on it: calls that arrive during another node's step batch together."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from mstar_core.graph import GraphNode
from mstar_core.runtime.engine import EngineContext, Invocation
from mstar_core.runtime.scheduler import NodeScheduler
from tests.core.helpers import Queued


class Gate(Queued):
    """Answers `x + 1` for every call it holds; records each step's batch; a step can be held on `hold`."""

    kind = "gate"

    def __init__(self, name: str):
        super().__init__(GraphNode(name, inputs="x", outputs="y", engine="gate"), None, EngineContext("t", "cpu", {}))
        self.batches: list[int] = []
        self.started, self.hold = threading.Event(), threading.Event()
        self.hold.set()

    def step(self):
        batch = self.take()
        self.batches.append(len(batch))
        self.started.set()
        self.hold.wait(5)
        return [(inv, {"y": inv.inputs["x"] + 1}) for inv in batch]


async def test_calls_reaching_a_node_while_another_steps_form_one_batch():
    device = ThreadPoolExecutor(max_workers=1)
    slow, fast = Gate("slow"), Gate("fast")
    slow.hold.clear()
    a, b = NodeScheduler(slow, device), NodeScheduler(fast, device)
    first = a.submit(Invocation("r0", "slow", {"x": 0}, {}))
    await asyncio.get_running_loop().run_in_executor(None, slow.started.wait, 5)
    later = []
    for i in range(4):  # one at a time, each seen by the fast node's loop before the next comes
        later.append(b.submit(Invocation(f"r{i + 1}", "fast", {"x": i}, {})))
        for _ in range(3):
            await asyncio.sleep(0)
    slow.hold.set()
    results = await asyncio.wait_for(asyncio.gather(first, *later), 5)
    assert results == [{"y": 1}, *({"y": i + 1} for i in range(4))]
    # without turns the first call would take a step queued behind the slow one alone, the rest the next
    assert fast.batches == [4] and slow.batches == [1]
    await a.close()
    await b.close()
    device.shutdown()


async def test_a_node_with_its_own_thread_does_not_wait_for_the_shared_one():
    device, own = ThreadPoolExecutor(max_workers=1), ThreadPoolExecutor(max_workers=1)
    slow, alone = Gate("slow"), Gate("alone")
    alone.own_thread = True
    slow.hold.clear()
    a, b = NodeScheduler(slow, device), NodeScheduler(alone, own)
    first = a.submit(Invocation("r0", "slow", {"x": 0}, {}))
    await asyncio.get_running_loop().run_in_executor(None, slow.started.wait, 5)
    assert await asyncio.wait_for(b.submit(Invocation("r1", "alone", {"x": 1}, {})), 5) == {"y": 2}
    assert not first.done()  # answered while the shared thread was still busy
    slow.hold.set()
    assert await asyncio.wait_for(first, 5) == {"y": 1}
    await a.close()
    await b.close()
    device.shutdown()
    own.shutdown()
