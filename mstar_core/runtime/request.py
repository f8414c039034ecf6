"""A request's handle: an async iterator of outputs, `result()`, `cancel()`."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import attrs

from mstar_core.errors import RequestCancelled

_END = object()

#: A request being read (iterated) may run this many emitted outputs ahead of its reader; its next node call then
#: waits for the reader (a credit) instead of buffering without bound. With one output per call (a token, an audio
#: chunk) a stream's unread memory is at most this many outputs; a request nobody iterates (only `result()`) has
#: no credit limit, its outputs are its final env anyway.
MAX_UNREAD = 64


@attrs.frozen
class Output:
    """A value the walk emitted: the env name, the value, and the walk that produced it.

    `branch` is the index of the dynamic fan-out branch (`Parallel(count=...)`) that emitted it, None
    outside one (in nested fan-outs, the innermost), so one stream can carry e.g. `n` choices apart.
    """

    name: str
    value: Any
    walk: str
    branch: int | None = None


class RequestHandle:
    """What `AsyncEngine.submit` returns.

    Iterate it (`async for out in handle`) to receive outputs as they are produced; await
    `result()` for the final env; `cancel()` to stop the request and free what it holds.
    """

    def __init__(self, request_id: str, model: str):
        self.request_id = request_id
        self.model = model
        #: the walks the request has started, in order (its plan and the walks its branches chose)
        self.walks: list[str] = []
        # emitted outputs not read yet; `_more` is set when one arrives while a reader waits (a plain deque
        # and one shared future: an asyncio.Queue costs a dozen calls per put and get, once per token)
        self._items: deque[Any] = deque()
        self._more: asyncio.Future | None = None
        self._task: asyncio.Task | None = None
        self._reading = False  # set by the first read: only a request that is read waits on its reader
        self._drained: asyncio.Future | None = None  # set when the reader has taken the backlog down to half

    def _attach(self, task: asyncio.Task) -> None:
        self._task = task
        task.add_done_callback(lambda _t: self._emit(_END))

    def _emit(self, output: Any) -> None:
        self._items.append(output)
        more = self._more
        if more is not None:
            self._more = None
            if not more.done():
                more.set_result(None)

    @property
    def done(self) -> bool:
        return self._task is not None and self._task.done()

    def cancel(self) -> None:
        """Stop the request; every engine it touched frees its state."""
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def credit(self) -> None:
        """Wait while the reader is MAX_UNREAD outputs behind (the conductor calls this before each node call)."""
        while self._reading and len(self._items) >= MAX_UNREAD:
            if self._drained is None or self._drained.done():
                self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    def __aiter__(self):
        return self

    async def __anext__(self) -> Output:
        self._reading = True
        items = self._items
        while not items:
            if self._more is None or self._more.done():  # (done: a reader waiting on it was cancelled)
                self._more = asyncio.get_running_loop().create_future()
            await self._more
        item = items.popleft()
        drained = self._drained
        if drained is not None and len(items) <= MAX_UNREAD // 2:
            self._drained = None
            if not drained.done():
                drained.set_result(None)
        if item is _END:
            items.appendleft(_END)  # later iterations end too
            await self._raise_if_failed()
            raise StopAsyncIteration
        return item

    async def _raise_if_failed(self) -> None:
        task = self._task
        if task is None:
            return
        if task.cancelled():
            raise RequestCancelled(f"request {self.request_id} was cancelled")
        exc = task.exception()
        if exc is not None:
            raise exc

    async def result(self) -> dict[str, Any]:
        """Wait for the request to finish; return its final env (raises what failed it)."""
        assert self._task is not None
        # whoever waits for the end reads no more outputs one by one: the request must not wait on a reader
        self._reading = False
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)
        try:
            return await asyncio.shield(self._task)
        except asyncio.CancelledError:
            if self._task.cancelled():
                raise RequestCancelled(f"request {self.request_id} was cancelled") from None
            raise
