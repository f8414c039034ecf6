"""ShmTransport: frames of at least `inline_max` bytes go through the sender's shared-memory arena,
smaller ones and all control ride on a ZeroMQ channel (IPC by default).

Control parts on the zmq channel (first part = kind):
  b"M" descriptor, inline...   one message; descriptor lists each frame as inline or (segment, offset, length)
  b"F" [[segment, offset]...]  the receiver released these slots
  b"U" segment                  the receiver mapped this segment; the owner may unlink its name
Received shm frames are zero-copy views; a slot returns to the sender once every view of it (and
every tensor decoded from it) is garbage. The transport is thread-safe, so the default async
variants (a worker thread) are safe to mix with sync calls.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from typing import Any

import orjson
from mstar_transport_zmq import ZmqTransport
from mstar_transport_zmq.transport import ipc_address

from mstar_core.wire.errors import TransportError
from mstar_core.wire.transport import Transport, TransportLink
from mstar_transport_shm.arena import Arena, Mapping

#: Frames smaller than this travel inline on the control channel (a copy is cheaper than a slot).
INLINE_MAX = 64 * 1024
#: recv polls in slices this long, flushing slot releases in between.
POLL_SLICE_S = 0.01


class ShmTransport(Transport):
    """Same-host transport: shared-memory arena for big frames, zmq IPC (or loopback TCP) for control."""

    name = "shm"
    same_host = True

    @classmethod
    def worker_link(cls, role: str) -> TransportLink:
        """Big frames of a spawned worker's messages through shared memory (see `mstar_transport_shm.link`)."""
        from mstar_transport_shm.link import ShmLink

        return ShmLink()

    def __init__(self, *, secret: bytes | None = None, segment_bytes: int = 256 << 20,
                 max_bytes: int = 4 << 30, inline_max: int = INLINE_MAX):
        self._ctl = ZmqTransport(secret=secret)
        self._arena: Arena | None = None
        self._arena_args = (segment_bytes, max_bytes)
        self.inline_max = inline_max
        self._maps = Mapping(self._released)
        self._pending: collections.deque[tuple[str, int]] = collections.deque()
        self._inbox: collections.deque[list[Any]] = collections.deque()
        self._lock = threading.RLock()

    def bind(self, address: str = "ipc://") -> str:
        """Bind the control channel; `ipc://` alone picks a private path. Only IPC or loopback TCP."""
        if address == "ipc://":
            address = ipc_address("mstar-shm")
        if not (address.startswith("ipc://") or address.startswith("tcp://127.")):
            raise TransportError(f"shm is same-host only; bind to ipc:// or tcp://127.0.0.1, not {address}")
        return self._ctl.bind(address)

    def connect(self, address: str) -> None:
        self._ctl.connect(address)

    def _released(self, name: str, offset: int) -> None:
        self._pending.append((name, offset))  # called from GC: just queue it, the owner thread sends

    def flush(self) -> None:
        """Tell the sender which slots we released (done automatically on send/recv)."""
        if not self._pending:
            return
        done = []
        while self._pending:
            done.append(self._pending.popleft())
        with self._lock:
            self._ctl.send([b"F", orjson.dumps(done)])

    def send(self, frames: Sequence[Any]) -> None:
        self.flush()
        with self._lock:
            self._drain()
            desc, inline = [], []
            for f in frames:
                mv = memoryview(f)
                slot = None
                if mv.nbytes >= self.inline_max:
                    if self._arena is None:
                        self._arena = Arena(*self._arena_args)
                    slot = self._arena.put(mv)
                if slot is None:  # small, or the arena is at max_bytes: inline beats blocking
                    desc.append(None)
                    inline.append(f)
                else:
                    desc.append(list(slot))
            retired = self._arena.retired if self._arena is not None else []
            head = {"d": desc, "r": retired}
            self._ctl.send([b"M", orjson.dumps(head), *inline])
            retired.clear()

    def _drain(self) -> None:
        """Handle whatever control traffic is queued, without blocking."""
        while True:
            try:
                parts = self._ctl.recv(0)
            except TimeoutError:
                return
            self._handle(parts)

    def _handle(self, parts: list[Any]) -> list[Any] | None:
        kind = bytes(parts[0])
        if kind == b"M":
            return self._unpack(parts)
        if kind == b"F" and self._arena is not None:
            for name, offset in orjson.loads(parts[1]):
                self._arena.free(name, offset)
        elif kind == b"U" and self._arena is not None:
            self._arena.mapped(bytes(parts[1]).decode())
        return None

    def _unpack(self, parts: list[Any]) -> list[Any]:
        head = orjson.loads(parts[1])
        for name in head["r"]:
            self._maps.forget(name)
        inline = iter(parts[2:])
        out = []
        for d in head["d"]:
            if d is None:
                out.append(next(inline))
                continue
            view, new = self._maps.view(*d)
            if new:
                self._ctl.send([b"U", d[0].encode()])
            out.append(view)
        self._inbox.append(out)
        return out

    def recv(self, timeout: float | None = None) -> list[Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.flush()
            with self._lock:
                if self._inbox:
                    return self._inbox.popleft()
                left = POLL_SLICE_S if deadline is None else min(POLL_SLICE_S, deadline - time.monotonic())
                try:
                    parts = self._ctl.recv(max(left, 0.0))
                except TimeoutError:
                    parts = None
                if parts is not None:
                    self._handle(parts)
                    if self._inbox:
                        return self._inbox.popleft()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no message within {timeout}s")

    def unpin(self) -> None:
        """Switch to a new peer (the old one died): forget its slots and segments."""
        with self._lock:
            self._ctl.unpin()
            if self._arena is not None:
                self._arena.reset()
            self._maps.close()

    def close(self) -> None:
        with self._lock:
            if self._arena is not None:
                self._arena.close()
            self._maps.close()
            self._ctl.close()
