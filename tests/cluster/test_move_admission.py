"""`max_active_requests` counts the requests whose state an engine holds: one moved away (export) frees its place.

A per-walk move (prefill on one worker, decode on another) exports the request's state and frees it
on the old worker; its admission there goes too, so the next request's prefill need not wait for the
first one's whole decode on the other worker.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import load_placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.runtime.engine import Invocation
from mstar_core.runtime.scheduler import NodeScheduler
from tests.cluster.helpers import kv_pages_used
from tests.core.helpers import Recording

pytestmark = pytest.mark.timeout(180)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "placement" / "llama-prefill-decode.yaml"


class Moving(Recording):
    """A Recording engine that answers `transfer` calls like a state-moving engine (an export of 'broken' fails)."""

    def step(self):
        batch, self.queue = self.queue, []
        self.order += [inv.request_id for inv in batch]
        out = []
        for inv in batch:
            failed = inv.options.get("transfer") == "export" and inv.request_id == "broken"
            out.append((inv, RuntimeError("export failed") if failed else {}))
        return out


def _inv(rid: str, arrival: float, index: int = 0, **options) -> Invocation:
    return Invocation(rid, "n", {}, options, index, 0.0, arrival)


async def test_an_exported_request_frees_its_place_and_a_failed_export_keeps_it():
    engine = Moving(max_batch_size=64, max_active=1)
    sched = NodeScheduler(engine, None)
    await sched.submit(_inv("a", 1.0))
    await sched.submit(_inv("a", 1.0, 1, transfer="export"))  # a's state left for another worker; a is not released
    await asyncio.wait_for(sched.submit(_inv("b", 2.0)), 5)  # the place is b's now
    back = sched.submit(_inv("a", 1.0, 2, transfer="import"))  # a's state coming back waits for b, though older
    await asyncio.sleep(0.05)
    assert not back.done()
    sched.release("b")
    await asyncio.wait_for(back, 5)
    sched.release("a")
    await asyncio.wait_for(sched.submit(_inv("broken", 0.5)), 5)
    with pytest.raises(Exception, match="export failed"):
        await asyncio.wait_for(sched.submit(_inv("broken", 0.5, 1, transfer="export")), 5)
    late = sched.submit(_inv("c", 3.0))  # 'broken' still holds its state here: c waits until it is released
    await asyncio.sleep(0.05)
    assert not late.done()
    sched.release("broken")
    await asyncio.wait_for(late, 5)
    await sched.close()


async def test_the_next_prefill_runs_while_the_first_request_decodes_on_the_other_worker():
    """One request at a time on each side: B's prefill (and first token) comes during A's decode, not after it."""
    engine = placed_engine(discover())
    settings = {"lm": {"num_pages": 1024, "max_active_requests": 1}}
    await engine.load_model("llama", LoadOptions(preset="tiny"), settings=settings,
                            placement=load_placement(EXAMPLE))
    try:
        events: list[str] = []
        decoding = asyncio.Event()

        async def run(name: str, request: dict) -> int:
            count = 0
            async for out in engine.submit("llama", request):
                if out.name == "next_token":
                    count += 1
                    events.append(f"{name}{count}")
                    if count == 2:  # the second token comes from the decode worker: the move is done
                        decoding.set()
            events.append(f"{name}-end")
            return count

        first = asyncio.ensure_future(run("A", {"input_ids": list(range(5, 40)), "max_tokens": 300,
                                                "ignore_eos": True}))
        await decoding.wait()
        second = asyncio.ensure_future(run("B", {"input_ids": [30, 31, 32], "max_tokens": 8, "ignore_eos": True}))
        counts = await asyncio.wait_for(asyncio.gather(first, second), 120)
        assert counts == [300, 8]  # both finish
        assert events.index("B1") < events.index("A-end"), events[events.index("A-end") - 3:][:8]
        for worker in ("prefill", "decode"):
            assert await kv_pages_used(engine, worker, "llama/lm") == 0, worker
    finally:
        await engine.close()
