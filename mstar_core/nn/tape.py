"""Record a run of CPU kernel calls once and replay it from C (`tape.cpp`): a decode step without its Python.

While a `Tape` records (`with tape.recording():`, on one thread), every kernel wrapper of `mstar_core.nn` and the
lane attention appends its call to the tape as it ran it: entry point, pointers, sizes. A torch dispatch guard
watches the same thread meanwhile. Allocations are kept alive by the tape (their addresses are in the calls: no
later tensor may reuse that memory), views are free, and any other torch op makes the recording unusable
(`failure` names it), since a replay runs the kernels alone. Replaying writes into the recorded buffers: the
caller copies fresh inputs into the tensors it recorded with and reads the results where the recording left them.

A recorded run's linears come in a fixed order, so each linear call is handed the next one's weight (a
`mstar::NextWeight` hint, its last argument): its threads start fetching that weight's first tasks into L2 near the
end of the call, and the next call starts on cached bytes instead of a cold stream (`NEXT_WEIGHT_BYTES` a thread;
bf16 panels only, and off by default: see the setting).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mstar_core.nn import native

SOURCE = Path(__file__).with_name("tape.cpp")
_ARGS = 12  # argument slots a call has (MAX_ARGS in tape.cpp)
_CODES = {ctypes.c_void_p: "p", ctypes.c_int64: "q", ctypes.c_int: "i", ctypes.c_float: "f", None: "v"}
#: The C signatures a tape replays (result, then arguments: p pointer, q int64, i int, f float), as tape.cpp's `Kind`
KINDS = {"i:pqpppqqqqip": 1, "i:pqppppqqqqip": 2, "v:pqppqqfi": 3, "v:ppqppqqfi": 4, "v:pqpqqi": 5, "v:pqqqqqppi": 6,
         "i:ppppppppp": 7, "v:ppqqqi": 8, "v:pqqqqqppfi": 9, "v:pqi": 10, "i:ppppp": 11, "v:pqpppqqfi": 12,
         "v:pqqqpi": 13}
#: The environment variable that sets `NEXT_WEIGHT_BYTES` (bytes, a whole number; 0 turns the hints off)
NEXT_WEIGHT_ENV = "MSTAR_NEXT_WEIGHT_BYTES"


def _next_weight_bytes() -> int:
    # (off by default: under the served process's OpenMP runtime the hints gained nothing, BENCHMARKS.md, issue 53)
    text = os.environ.get(NEXT_WEIGHT_ENV, "0")
    if not text.isdigit():
        raise ValueError(f"{NEXT_WEIGHT_ENV} must be a whole number of bytes (0: no next-weight hints), got {text!r}")
    return int(text)


#: Bytes of the next linear's weight each thread of a linear call fetches into L2 near its end (at most the next
#: call's first task a thread, and what a cache line an input step of the call's last task covers); 0 (default): none
NEXT_WEIGHT_BYTES = _next_weight_bytes()
_ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
                torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty_strided.default}


def _code(argtype) -> str:
    if isinstance(argtype, type) and issubclass(argtype, ctypes._Pointer):
        return "p"
    return _CODES.get(argtype, "?")


def _kind(entry) -> int | None:
    signature = _code(entry.restype) + ":" + "".join(_code(t) for t in entry.argtypes)
    return KINDS.get(signature)


class NextWeight(ctypes.Structure):
    """`mstar::NextWeight` (mstar_native.h): the next linear call's weight, for a linear call to start fetching."""

    _fields_ = [("start", ctypes.c_int64), ("bytes", ctypes.c_int64), ("stride", ctypes.c_int64)]


def _runner():
    return native.function(SOURCE, "mstar_tape_run", [ctypes.c_void_p, ctypes.c_int64], ctypes.c_int64)


def available() -> bool:
    """Whether tapes replay here (the replay loop built, with the layout this module writes)."""
    size = native.function(SOURCE, "mstar_tape_op_bytes", [], ctypes.c_int64)
    return size is not None and size() == 8 * (2 + _ARGS)


def warm_recording() -> None:
    """Pay a recording's one-off cost now: torch imports `torch._dynamo` the first time a dispatch mode runs an op
    (1-3 s of imports on a 2-core box), which otherwise lands in the first request's first decode step."""
    with _Guard(Tape()):
        torch.empty(0)


class Tape:
    """Kernel calls recorded in order, the tensors they write kept alive, and whether a replay may stand for the run."""

    def __init__(self) -> None:
        self.calls: list[int] = []  # flat: per call, its entry's address, its kind and _ARGS argument slots
        self.count = 0
        self.keep: list[torch.Tensor] = []  # every tensor allocated while recording
        self.failure: str | None = None  # what made the recording unusable (None: usable)
        self._array = None
        self._address = 0  # the recorded calls' address, and the C loop that replays them (set when recorded)
        self._runner = None
        # per linear call in order: (where its hint argument sits in `calls`, its weight's address, its hint stride)
        self._linears: list[tuple[int, int, int]] = []
        self._hints = None  # the linears' NextWeight hints, which the replayed calls point into
        self._names: list[str] | None = None  # each call's entry point's name (`replay_timed`), found on first use

    def record(self, entry, args: tuple, weight: tuple[int, int] | None = None) -> None:
        """Append a kernel call (`entry` a ctypes function, `args` as it was called with).

        `weight`: a linear call's (packed weight address, `task_bytes` stride or 0), its last argument the slot of
        its next-weight hint (filled in when the recording ends).
        """
        if self.failure is not None:
            return
        kind = _kind(entry)
        if kind is None or len(args) > _ARGS:
            self.failure = f"kernel {getattr(entry, '__name__', entry)} (a signature tapes do not replay)"
            return
        slots = [0] * _ARGS
        for i, (value, argtype) in enumerate(zip(args, entry.argtypes, strict=True)):
            if argtype is ctypes.c_float:
                slots[i] = struct.unpack("<i", struct.pack("<f", value))[0]
            elif value is not None:
                slots[i] = int(value)
        if weight is not None:
            self._linears.append((len(self.calls) + 2 + len(args) - 1, *weight))
        self.calls += [ctypes.cast(entry, ctypes.c_void_p).value, kind, *slots]
        self.count += 1

    @contextlib.contextmanager
    def recording(self) -> Iterator[Tape]:
        """Record the kernel calls this thread makes in the block (torch ops other than allocations and views spoil it)."""
        thread = threading.get_ident()
        with _RECORDING.lock:
            if thread in _RECORDING.tapes:
                raise RuntimeError("a tape is already recording on this thread")
            _RECORDING.tapes[thread] = self
            native.RECORDER = _RECORDING
        try:
            with _Guard(self):  # (dispatch modes are per thread too)
                yield self
        finally:
            with _RECORDING.lock:
                del _RECORDING.tapes[thread]
                if not _RECORDING.tapes:
                    native.RECORDER = None
        if self.failure is None and not self.count:
            self.failure = "no kernel call"
        if self.failure is None:
            self._hints = (NextWeight * len(self._linears))()
            for i, (slot, _, _) in enumerate(self._linears):  # (the last linear has none after it: its hint stays 0)
                self.calls[slot] = ctypes.addressof(self._hints) + i * ctypes.sizeof(NextWeight)
            self._array = (ctypes.c_int64 * len(self.calls))(*self.calls)
            self._address = ctypes.addressof(self._array)
            self._runner = _runner()  # (resolved once: a replay is one C call, and little Python after a cold step)
            self.hint_next_weights(NEXT_WEIGHT_BYTES)

    def hint_next_weights(self, per_thread: int) -> None:
        """Have each recorded linear call fetch up to `per_thread` bytes a thread of the next one's weight (0: none)."""
        for hint, (_, start, stride) in zip(self._hints or (), self._linears[1:], strict=False):  # (the last: none)
            hint.start, hint.stride = start, stride
            hint.bytes = min(per_thread, stride)  # (a stride of 0: a kernel that takes no hint)

    def next_weight_hints(self) -> list[tuple[int, int, int]]:
        """Each recorded linear call's hint, in order: (next weight's address, bytes a thread fetches, stride)."""
        return [(hint.start, hint.bytes, hint.stride) for hint in self._hints or ()]

    def replay(self) -> None:
        """Run the recorded calls again, in order, from C (the GIL released)."""
        if self._array is None:
            raise RuntimeError(f"this tape does not replay: {self.failure or 'not recorded'}")
        failed = self._runner(self._address, self.count)
        if failed:
            raise RuntimeError(f"replayed kernel call {failed - 1} refused (not built for this CPU, or no memory)")

    def replay_timed(self) -> list[tuple[str, int]]:
        """`replay`, timing each call: (its entry point's name, nanoseconds) per call in order (benchmarks' split)."""
        if self._array is None:
            raise RuntimeError(f"this tape does not replay: {self.failure or 'not recorded'}")
        if self._names is None:
            self._names = [_entry_name(self.calls[i * (2 + _ARGS)]) for i in range(self.count)]
        ns = (ctypes.c_int64 * self.count)()
        timed = native.function(SOURCE, "mstar_tape_run_timed", [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p],
                                ctypes.c_int64)
        failed = timed(ctypes.addressof(self._array), self.count, ctypes.addressof(ns))
        if failed:
            raise RuntimeError(f"replayed kernel call {failed - 1} refused (not built for this CPU, or no memory)")
        return list(zip(self._names, ns, strict=True))

    def nbytes(self) -> int:
        """Bytes of the buffers the tape keeps."""
        return sum(t.untyped_storage().nbytes() for t in self.keep)


def _entry_name(address: int) -> str:
    """The exported name of the function at `address` (dladdr), or its address."""
    info = _DlInfo()
    if _LIBDL.dladdr(ctypes.c_void_p(address), ctypes.byref(info)) and info.dli_sname:
        return info.dli_sname.decode()
    return hex(address)


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p), ("dli_sname", ctypes.c_char_p),
                ("dli_saddr", ctypes.c_void_p)]


_LIBDL = ctypes.CDLL(None)
_LIBDL.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]


class _Recordings:
    """The tapes recording now, by thread: `native.RECORDER` while any records (each kernel call goes to its thread's)."""

    def __init__(self) -> None:
        self.tapes: dict[int, Tape] = {}
        self.lock = threading.Lock()

    def record(self, entry, args: tuple, weight: tuple[int, int] | None = None) -> None:
        tape = self.tapes.get(threading.get_ident())
        if tape is not None:
            tape.record(entry, args, weight)


_RECORDING = _Recordings()


class _Guard(TorchDispatchMode):
    """Keeps what the recording allocates; notes the first torch op that computes (a replay would skip it)."""

    def __init__(self, tape: Tape):
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.tape.keep.append(out)
        elif not func.is_view and self.tape.failure is None:
            self.tape.failure = f"torch op {func}"
        return out
