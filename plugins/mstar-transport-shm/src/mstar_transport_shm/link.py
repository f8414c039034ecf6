"""The `shm` worker link: big tensor frames between the server and a spawned worker on the same host.

Messages still travel on the ZeroMQ control socket, but each frame of at least `THRESHOLD` bytes
(tensors) is copied once into the sender's shared-memory arena and replaced by a descriptor; the
receiver maps the segment and decodes tensors straight from it (zero-copy receive).

A packed message is `[DATA, {"d": [null | [segment, offset, length], ...], "r": [retired segments]},
inline frames...]`; `[CONTROL, {"f": [[segment, offset], ...], "u": [segment, ...]}]` tells the sender
which slots the receiver released and which segments it mapped (so their names can be unlinked at
once: a process killed later leaves nothing in /dev/shm). A JSON header frame starts with `{`, so
the two magic frames can never be mistaken for a plain message.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from mstar_core.wire.errors import WireError
from mstar_core.wire.transport import TransportLink
from mstar_transport_shm.arena import Arena, Mapping, sweep_stale

DATA = b"mstar-shm-data/1"
CONTROL = b"mstar-shm-ctl/1"
#: Frames smaller than this stay inline on the control socket (a copy is cheaper than a slot).
THRESHOLD = 64 * 1024


def kind(frames: Sequence[Any]) -> bytes | None:
    """DATA or CONTROL for a packed message, None for a plain wire message."""
    if not frames:
        return None
    first = memoryview(frames[0])
    if first.nbytes in (len(DATA), len(CONTROL)):
        tag = bytes(first)
        if tag in (DATA, CONTROL):
            return tag
    return None


class ShmLink(TransportLink):
    """One end of a server<->worker shm path: an arena for what it sends, mappings of what it receives."""

    def __init__(self, threshold: int = THRESHOLD, segment_bytes: int = 64 << 20, max_bytes: int = 1 << 30):
        super().__init__("shm")
        self.threshold = threshold
        self._arena_args = (segment_bytes, max_bytes)
        self.arena = None
        self.maps = Mapping(self._released)
        self._freed: collections.deque[tuple[str, int]] = collections.deque()
        self._mapped: collections.deque[str] = collections.deque()
        self.sent_shm = self.sent_inline = self.received_shm = 0
        self.last_received: list[tuple[int, int]] = []  # (address, bytes) of the last message's shm frames

    def _released(self, name: str, offset: int) -> None:
        self._freed.append((name, offset))  # runs from GC on any thread: only queue it

    def _pack(self, frames: Sequence[Any]) -> list[Any]:
        """Move big frames into the arena; when the arena is at its limit they go inline instead of blocking."""
        desc, inline = [], []
        for frame in frames:
            view = memoryview(frame)
            slot = None
            if view.nbytes >= self.threshold:
                if self.arena is None:
                    self.arena = Arena(*self._arena_args)
                slot = self.arena.put(view)
            if slot is None:
                desc.append(None)
                inline.append(frame)
                self.sent_inline += 1
            else:
                desc.append(list(slot))
                self.sent_shm += 1
                self.stats.offloaded_bytes += view.nbytes
        retired: list[str] = []
        if self.arena is not None:
            retired, self.arena.retired = self.arena.retired, []
        return [DATA, orjson.dumps({"d": desc, "r": retired}), *inline]

    def _unpack(self, frames: Sequence[Any]) -> list[Any] | None:
        """A packed message's original frames (shm ones as zero-copy views), or None for a control message."""
        if kind(frames) is None:
            return list(frames)  # a plain message
        try:
            head = orjson.loads(frames[1])
            if kind(frames) == CONTROL:
                for name, offset in head["f"]:
                    if self.arena is not None:
                        self.arena.free(name, offset)
                for name in head["u"]:
                    if self.arena is not None:
                        self.arena.mapped(name)
                return None
            for name in head["r"]:
                self.maps.forget(name)
            inline = iter(frames[2:])
            out, self.last_received = [], []
            for d in head["d"]:
                if d is None:
                    out.append(next(inline))
                    continue
                name, offset, length = d
                view, new = self.maps.view(str(name), int(offset), int(length))
                if new:
                    self._mapped.append(name)
                self.received_shm += 1
                self.last_received.append((np.frombuffer(view, dtype=np.uint8).ctypes.data, length))
                out.append(view)
            return out
        except (KeyError, TypeError, ValueError, IndexError, StopIteration, orjson.JSONDecodeError) as exc:
            raise WireError(f"malformed shared-memory message: {type(exc).__name__}: {exc}") from None

    def control(self) -> list[Any] | None:
        """The pending control message (released slots, mapped segments) for the peer, if any."""
        if not self._freed and not self._mapped:
            return None
        freed = [self._freed.popleft() for _ in range(len(self._freed))]
        mapped = [self._mapped.popleft() for _ in range(len(self._mapped))]
        return [CONTROL, orjson.dumps({"f": freed, "u": mapped})]

    def peer_lost(self) -> None:
        """The peer died: drop every slot and mapping, and unlink segments dead processes left behind."""
        if self.arena is not None:
            self.arena.reset()
        self.maps.close()
        self._freed.clear()
        self._mapped.clear()
        sweep_stale()

    def close(self) -> None:
        """Unlink and unmap everything this end owns or maps."""
        if self.arena is not None:
            self.arena.close()
        self.maps.close()
