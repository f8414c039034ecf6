"""The text routes' own queues hold a request back for a slow client (issue 31, item 6).

A real `RequestHandle` fed by a producer that, as the conductor does, awaits the handle's credit
before each output. Read through `choices.events` (what a streamed chat or completions body
iterates) or a shared request's branches (`n` forks), slowly: the outputs produced and not yet
read stay within the handle's credit plus the routes' own `EVENTS_AHEAD` per choice, instead of
growing with the producer's speed. A finished branch never holds the others. A client that
disconnects from a non-streamed request leaves no "exception was never retrieved" behind.
"""

import asyncio
import gc

import pytest

from mstar_core.api.http.errors import ApiError
from mstar_core.api.requests import choices as ch
from mstar_core.runtime.request import MAX_UNREAD, Output, RequestHandle

pytestmark = pytest.mark.timeout(60)


class Adapter:
    """Just what a choice's text asks of an adapter: every token is one letter, none stops."""

    token_output = "next_token"
    logprob_output = "logprob"
    top_logprobs_output = "top_logprobs"

    def is_stop_token(self, token_id: int) -> bool:
        return False

    def detokenize(self, ids) -> str:
        return "a" * len(ids)


def producing(total: int, branches: int | None = None) -> tuple[RequestHandle, list[int]]:
    """A handle whose request emits `total` tokens as fast as its credit allows; [outputs produced so far]."""
    handle = RequestHandle("r", "m")
    produced = [0]

    async def run() -> dict:
        for i in range(total):
            await handle.credit()  # the conductor awaits this before each node call
            handle._emit(Output("next_token", 1, "w", branch=None if branches is None else i % branches))
            produced[0] += 1
            if i % 4 == 0:
                await asyncio.sleep(0)
        return {}

    handle._attach(asyncio.ensure_future(run()))
    return handle, produced


async def started(handle: RequestHandle) -> ch.Choice:
    choice = ch.Choice(0, 0, handle, Adapter(), [], None)
    rest = handle.__aiter__()
    choice.first, choice.rest = await rest.__anext__(), rest
    return choice


async def test_a_slow_stream_reader_holds_its_choice_back():
    handle, produced = producing(1_000_000)
    choice = await started(handle)
    stream = ch.events([choice])
    read = worst = 0
    try:
        async for _event in stream:
            read += 1
            await asyncio.sleep(0.002)  # a client reading slowly
            worst = max(worst, produced[0] - read)
            if read == 300:
                break
    finally:
        await stream.aclose()
        handle.cancel()
    assert worst <= MAX_UNREAD + ch.EVENTS_AHEAD + 8, worst


async def test_shared_branches_are_bounded_and_a_finished_one_holds_none():
    handle, produced = producing(1_000_000, branches=2)
    shared = ch.SharedRequest(handle, 2)
    first, second = shared.branch(0), shared.branch(1)
    worst = 0
    try:
        for i in range(200):
            await asyncio.wait_for(first.__anext__(), 5)
            await asyncio.wait_for(second.__anext__(), 5)
            await asyncio.sleep(0.002)
            worst = max(worst, produced[0] - 2 * (i + 1))
        assert worst <= MAX_UNREAD + 2 * ch.EVENTS_AHEAD + 8, worst
        second.cancel()  # that choice is done: its outputs are dropped, the first reads on
        for _ in range(1000):
            await asyncio.wait_for(first.__anext__(), 5)
        assert shared.queues[1].qsize() == 0
    finally:
        handle.cancel()


class Disconnecting:
    """A starlette Request whose client hangs up after a moment."""

    async def receive(self):
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}


async def test_a_disconnect_during_run_all_leaves_no_unretrieved_exception():
    loop = asyncio.get_running_loop()
    said: list[str] = []
    loop.set_exception_handler(lambda _loop, context: said.append(str(context.get("message"))))
    try:
        handle, _ = producing(1_000_000)
        choice = await started(handle)
        status = None
        try:  # not pytest.raises: its traceback would keep the gather alive past the collection below
            await ch.run_all(Disconnecting(), [choice])
        except ApiError as exc:
            status = exc.status
        assert status == 499
        del choice, handle
        for _ in range(5):
            await asyncio.sleep(0.01)
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert not [m for m in said if "never retrieved" in m], said
