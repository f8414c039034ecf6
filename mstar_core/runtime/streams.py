"""One request's side of a streaming edge: the policy's state, released chunks, who waits for them.

The producer pushes items as its calls finish (`push`), the stage that produces them closes the
stream when it ends (`close`: the policy flushes or drops its tail), and the consumer takes chunks
in order (`take` for a consumer fragment, `next_chunk` for a per-chunk consumer). Every chunk is
handed out once; `progress` is what a priority function sees.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import attrs

from mstar_core.graph.walk import StreamingGraphEdge, StreamProgress
from mstar_core.streaming.policies import Chunk


class RequestStream:
    __slots__ = ("_ready", "_wakeup", "chunks", "closed", "edge", "first_release", "keep", "released", "src_output",
                 "started", "state", "accounting", "taken", "unread")

    def __init__(self, edge: StreamingGraphEdge, started: float | None = None, accounting: bool = False):
        self.edge = edge
        self.keep = edge.keep
        self.src_output = edge.src_output  # read for every value its producer emits
        self.state = edge.policy.open()
        self.started = time.monotonic() if started is None else started
        self._ready: deque[Chunk] = deque()
        self._wakeup = asyncio.Event()
        self.closed = False
        self.chunks = 0  # chunks released
        self.released = 0  # items released (each counted once, context excluded)
        self.taken = 0  # chunks handed to the consumer
        self.unread = 0  # items of chunks the consumer ended without taking
        self.first_release: float | None = None
        self.accounting = accounting  # only counts (a worker measuring progress): keeps no chunks

    # -- producer side ---------------------------------------------------------------------------

    def push(self, value: Any) -> None:
        """One produced value: part of the stream unless the edge's `keep` says otherwise."""
        if self.keep is not None and not self.keep(value):
            return
        self.push_kept(value)

    def push_kept(self, value: Any) -> None:
        """One value already known to be part of the stream (its producer worker applied `keep`)."""
        self._release(self.state.push(value))

    def close(self) -> None:
        """The producing stage ended: the policy flushes (or drops) its tail; takers then see the end."""
        if self.closed:
            return
        self._release(self.state.close())
        self.closed = True
        self._wakeup.set()

    def end_segment(self) -> None:
        """The producer ended one segment (its loop's iteration, `StreamingGraphEdge.segment_by`) and goes on."""
        if not self.closed:
            self._release(self.state.end_segment())

    def _release(self, chunks: list[Chunk]) -> None:
        if not chunks:
            return
        if self.first_release is None:
            self.first_release = time.monotonic()
        for chunk in chunks:
            self.chunks += 1
            self.released += len(chunk.new_items)
            if not self.accounting:
                self._ready.append(chunk)
        self._wakeup.set()

    def progress(self, now: float | None = None) -> StreamProgress:
        return StreamProgress(items=self.state.total, released=self.released, chunks=self.chunks,
                              started=self.started, first_release=self.first_release,
                              now=time.monotonic() if now is None else now)

    # -- consumer side ---------------------------------------------------------------------------

    @property
    def drained(self) -> bool:
        """The producer finished and every chunk was taken."""
        return self.closed and not self._ready

    async def wait_ready_or_closed(self) -> None:
        while not self._ready and not self.closed:
            self._wakeup.clear()
            await self._wakeup.wait()

    async def next_chunk(self) -> Chunk | None:
        """The next chunk, waiting while none is ready; None once the stream is drained."""
        await self.wait_ready_or_closed()
        if not self._ready:
            return None
        return self._pop()

    async def take(self) -> Chunk:
        """The next chunk for a consumer fragment; an empty final chunk once the stream is drained."""
        chunk = await self.next_chunk()
        if chunk is None:
            return Chunk((), self.state.total, 0, final=True)
        return chunk

    def _pop(self) -> Chunk:
        chunk = self._ready.popleft()
        self.taken += 1
        if self.closed and not self._ready and not chunk.final:
            chunk = attrs.evolve(chunk, final=True)  # known to be the last one now
        return chunk

    def finish_reading(self) -> None:
        """The consumer ended: count what it left (it ends only once drained, unless a max_iters cut it off)."""
        self.unread += sum(len(c.new_items) for c in self._ready)
        self._ready.clear()
