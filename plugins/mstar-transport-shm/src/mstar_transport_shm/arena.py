"""Shared-memory segments: the sender's arena (allocation) and the receiver's mappings (zero-copy views).

Lifetime, so nothing leaks when a process dies: a segment is a file `/dev/shm/mstar-shm-<pid>-<token>-<n>`
named after its owner's pid. The owner unlinks the name as soon as the receiver confirms it mapped
it (the memory then lives exactly as long as the two mappings, and the kernel frees it when both
processes are gone, however they die), and at close/exit. A segment whose owner died before that
point is removed by `sweep_stale()`, which every new arena runs.
"""

from __future__ import annotations

import atexit
import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Callable

import numpy as np

from mstar_core.wire.errors import TransportError

SHM_DIR = "/dev/shm"
PREFIX = "mstar-shm-"
ALIGN = 64


def segment_names(pid: int | None = None) -> list[str]:
    """Names of M* segments present now (all, or those owned by `pid`)."""
    if not os.path.isdir(SHM_DIR):
        return []
    want = PREFIX if pid is None else f"{PREFIX}{pid}-"
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(want))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Unlink segments whose owner process no longer exists; returns the names removed."""
    removed = []
    for name in segment_names():
        pid = name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


class _Segment:
    """One owned segment: a mapped file plus its live allocations (offset -> size)."""

    def __init__(self, name: str, size: int):
        self.name, self.size = name, size
        self.path = os.path.join(SHM_DIR, name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.view = memoryview(self.mm)
        self.live: dict[int, int] = {}
        self.linked = True

    def alloc(self, n: int) -> int | None:
        n = -(-max(n, 1) // ALIGN) * ALIGN
        pos = 0
        for off, size in sorted(self.live.items()):
            if off - pos >= n:
                break
            pos = max(pos, off + size)
        if pos + n > self.size:
            return None
        self.live[pos] = n
        return pos

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.unlink()
        self.view.release()
        self.mm.close()


class Arena:
    """Sender side: allocates frame slots in owned segments, growing (up to `max_bytes`) instead of blocking."""

    def __init__(self, segment_bytes: int = 256 << 20, max_bytes: int = 4 << 30):
        sweep_stale()
        self.segment_bytes, self.max_bytes = segment_bytes, max_bytes
        self.token = secrets.token_hex(4)
        self.segments: dict[str, _Segment] = {}
        self._count = 0
        self.retired: list[str] = []  # closed segments the receiver should unmap too
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, Arena._close_all, self.segments)
        atexit.register(self._finalizer)

    def put(self, frame: memoryview) -> tuple[str, int, int] | None:
        """Copy `frame` into a free slot; returns (segment, offset, length), or None when full at max_bytes."""
        n = frame.nbytes
        with self._lock:
            for seg in reversed(self.segments.values()):
                off = seg.alloc(n)
                if off is not None:
                    break
            else:
                seg = self._grow(n)
                if seg is None:
                    return None
                off = seg.alloc(n)
            seg.view[off : off + n] = frame.cast("B") if frame.format != "B" or frame.ndim != 1 else frame
        return seg.name, off, n

    def _grow(self, n: int) -> _Segment | None:
        size = max(self.segment_bytes, 1 << (n - 1).bit_length())
        if sum(s.size for s in self.segments.values()) + size > self.max_bytes:
            return None
        self._count += 1
        name = f"{PREFIX}{os.getpid()}-{self.token}-{self._count}"
        seg = _Segment(name, size)
        self.segments[name] = seg
        return seg

    def free(self, name: str, offset: int) -> None:
        """The receiver is done with a slot; retire emptied older segments."""
        with self._lock:
            seg = self.segments.get(name)
            if seg is None or seg.live.pop(offset, None) is None:
                return
            newest = next(reversed(self.segments))
            if not seg.live and name != newest:
                del self.segments[name]
                seg.close()
                self.retired.append(name)

    def mapped(self, name: str) -> None:
        """The receiver mapped `name`: drop the file name now so a crash cannot leak it."""
        with self._lock:
            if name in self.segments:
                self.segments[name].unlink()

    def reset(self) -> None:
        """Forget every slot (the receiver went away): close all segments, start over."""
        with self._lock:
            Arena._close_all(self.segments)

    @staticmethod
    def _close_all(segments: dict[str, _Segment]) -> None:
        for seg in list(segments.values()):
            try:
                seg.close()
            except BufferError:  # a local export still alive; the name is gone, memory goes at exit
                seg.unlink()
        segments.clear()

    def close(self) -> None:
        """Unlink and unmap every segment."""
        self._finalizer()


class Mapping:
    """Receiver side: maps peers' segments and hands out zero-copy views that report their own release."""

    def __init__(self, on_release: Callable[[str, int], None]):
        self._maps: dict[str, mmap.mmap] = {}
        self._on_release = on_release

    def view(self, name: str, offset: int, length: int) -> tuple[memoryview, bool]:
        """A read-write view of a peer slot; returns (view, newly_mapped). The slot frees when it dies."""
        if not name.startswith(PREFIX) or "/" in name:
            raise TransportError(f"bad shared-memory segment name {name!r}")
        new = name not in self._maps
        if new:
            try:
                fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
            except FileNotFoundError:
                raise TransportError(f"shared-memory segment {name} vanished (its owner died?)") from None
            try:
                self._maps[name] = mmap.mmap(fd, 0)
            finally:
                os.close(fd)
        mm = self._maps[name]
        if offset < 0 or length < 0 or offset + length > len(mm):
            raise TransportError(f"slot {offset}+{length} is outside segment {name} ({len(mm)} bytes)")
        arr = np.frombuffer(mm, dtype=np.uint8, count=length, offset=offset)
        weakref.finalize(arr, self._on_release, name, offset)
        return memoryview(arr), new

    def forget(self, name: str) -> None:
        """Drop our handle on a segment (its memory stays mapped while views are alive)."""
        mm = self._maps.pop(name, None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass

    def close(self) -> None:
        for name in list(self._maps):
            self.forget(name)
