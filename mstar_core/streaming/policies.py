"""Chunk policies: when a streaming consumer fires on a producer's partial output.

A policy is an immutable spec; `policy.open()` makes the per-request `ChunkStream` that the
runtime owns. Every chunk says how many of its leading items were already delivered in an
earlier chunk (`num_context`), so concatenating `chunk.new_items` over a stream gives back the
stream exactly: nothing lost, nothing repeated, except a tail that a policy declares it drops.
"""

from __future__ import annotations

import abc
from collections import deque
from typing import Any, Literal

import attrs

Tail = Literal["flush", "drop"]


@attrs.frozen
class Chunk:
    """One firing of a consumer: `items[:num_context]` were seen before, the rest are new."""

    items: tuple[Any, ...]
    start: int
    num_context: int
    final: bool = False

    @property
    def new_items(self) -> tuple[Any, ...]:
        return self.items[self.num_context :]

    def __len__(self) -> int:
        return len(self.items)


class ChunkStream(abc.ABC):
    """Per-request state of one streaming edge: feed items in, get chunks out."""

    def __init__(self) -> None:
        self.total = 0
        self.dropped = 0
        self.closed = False

    def push(self, item: Any) -> list[Chunk]:
        if self.closed:
            raise RuntimeError("push() after close(): the producer already finished")
        self.total += 1
        return self._push(item)

    def close(self) -> list[Chunk]:
        """The producer finished: flush the tail or drop it, as the policy says."""
        if self.closed:
            return []
        self.closed = True
        return self._close()

    def end_segment(self) -> list[Chunk]:
        """The producer finished one segment of the stream (one utterance of several) and goes on: its tail is
        released (or dropped) as at the producer's end, in chunks not marked final, and the next segment starts
        afresh (no window or left context reaches back across the boundary)."""
        if self.closed:
            return []
        chunks = [attrs.evolve(c, final=False) for c in self._close()]
        self._reset()
        return chunks

    def _reset(self) -> None:  # noqa: B027 (a policy that keeps nothing past its tail has nothing to forget)
        """Forget what the segment left behind (`_close` already released or dropped its tail)."""

    @abc.abstractmethod
    def _push(self, item: Any) -> list[Chunk]: ...

    @abc.abstractmethod
    def _close(self) -> list[Chunk]: ...


class ChunkPolicy(abc.ABC):
    """Spec of when to fire; `open()` creates the per-request state."""

    tail: Tail

    @abc.abstractmethod
    def open(self) -> ChunkStream: ...

    def _check_tail(self) -> None:
        if self.tail not in ("flush", "drop"):
            raise ValueError(f"tail must be 'flush' or 'drop', got {self.tail!r}")


# ---------------------------------------------------------------------------------------------


@attrs.frozen
class FixedChunkPolicy(ChunkPolicy):
    """Fire every `size` items. On finish, a shorter tail chunk is flushed (default) or dropped."""

    size: int
    tail: Tail = "flush"

    def __attrs_post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"FixedChunkPolicy.size must be >= 1, got {self.size}")
        self._check_tail()

    def open(self) -> ChunkStream:
        return _FixedStream(self)


class _FixedStream(ChunkStream):
    def __init__(self, policy: FixedChunkPolicy):
        super().__init__()
        self.policy = policy
        self.buffer: list[Any] = []

    def _push(self, item: Any) -> list[Chunk]:
        self.buffer.append(item)
        if len(self.buffer) < self.policy.size:
            return []
        chunk = Chunk(tuple(self.buffer), self.total - len(self.buffer), 0)
        self.buffer = []
        return [chunk]

    def _close(self) -> list[Chunk]:
        if not self.buffer:
            return []
        if self.policy.tail == "drop":
            self.dropped = len(self.buffer)
            self.buffer = []
            return []
        chunk = Chunk(tuple(self.buffer), self.total - len(self.buffer), 0, final=True)
        self.buffer = []
        return [chunk]


# ---------------------------------------------------------------------------------------------


@attrs.frozen
class SlidingWindowChunkPolicy(ChunkPolicy):
    """Once `window` items are buffered, fire with the last `window` items every `stride` items.

    Consecutive windows overlap by `window - stride` items. On finish, items no window has
    covered yet are dropped (default, as the Orpheus reference decoder does) or flushed as one
    last window ending at the final item (shorter than `window` if the stream was).
    """

    window: int
    stride: int
    tail: Tail = "drop"

    def __attrs_post_init__(self) -> None:
        if self.window < 1 or self.stride < 1:
            raise ValueError("SlidingWindowChunkPolicy needs window >= 1 and stride >= 1")
        if self.stride > self.window:
            raise ValueError(
                f"stride {self.stride} > window {self.window} would skip items; use stride <= window"
            )
        self._check_tail()

    def open(self) -> ChunkStream:
        return _SlidingStream(self)


class _SlidingStream(ChunkStream):
    def __init__(self, policy: SlidingWindowChunkPolicy):
        super().__init__()
        self.policy = policy
        self.buffer: deque[Any] = deque(maxlen=policy.window)
        self.covered = 0  # items [0, covered) have been delivered
        self.segment_start = 0  # the stream index where the current segment began

    def _emit(self, final: bool) -> Chunk:
        items = tuple(self.buffer)
        start = self.total - len(items)
        chunk = Chunk(items, start, self.covered - start, final=final)
        self.covered = self.total
        return chunk

    def _reset(self) -> None:
        self.buffer.clear()
        self.covered = self.total
        self.segment_start = self.total

    def _push(self, item: Any) -> list[Chunk]:
        self.buffer.append(item)
        w, s = self.policy.window, self.policy.stride
        seen = self.total - self.segment_start  # (windows count from the segment's start)
        if seen >= w and (seen - w) % s == 0:
            return [self._emit(final=False)]
        return []

    def _close(self) -> list[Chunk]:
        uncovered = self.total - self.covered
        if uncovered == 0:
            return []
        if self.policy.tail == "drop":
            self.dropped = uncovered
            return []
        return [self._emit(final=True)]


# ---------------------------------------------------------------------------------------------


@attrs.frozen
class LeftContextChunkPolicy(ChunkPolicy):
    """Fire every `chunk` new items, prefixed with up to `left` items already delivered.

    The consumer trims the output of the `num_context` prefix (Code2Wav's left context). On
    finish, the remaining new items are flushed with their left context (default) or dropped.
    """

    chunk: int
    left: int
    tail: Tail = "flush"

    def __attrs_post_init__(self) -> None:
        if self.chunk < 1 or self.left < 0:
            raise ValueError("LeftContextChunkPolicy needs chunk >= 1 and left >= 0")
        self._check_tail()

    def open(self) -> ChunkStream:
        return _LeftContextStream(self)


class _LeftContextStream(ChunkStream):
    def __init__(self, policy: LeftContextChunkPolicy):
        super().__init__()
        self.policy = policy
        self.context: deque[Any] = deque(maxlen=policy.left) if policy.left else deque(maxlen=0)
        self.fresh: list[Any] = []

    def _reset(self) -> None:
        self.context.clear()

    def _emit(self, final: bool) -> Chunk:
        items = tuple(self.context) + tuple(self.fresh)
        chunk = Chunk(items, self.total - len(items), len(self.context), final=final)
        self.context.extend(self.fresh)
        self.fresh = []
        return chunk

    def _push(self, item: Any) -> list[Chunk]:
        self.fresh.append(item)
        if len(self.fresh) < self.policy.chunk:
            return []
        return [self._emit(final=False)]

    def _close(self) -> list[Chunk]:
        if not self.fresh:
            return []
        if self.policy.tail == "drop":
            self.dropped = len(self.fresh)
            self.fresh = []
            return []
        return [self._emit(final=True)]
