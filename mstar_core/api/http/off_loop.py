"""Work off the event loop: the server's one bounded thread pool, started whole, its malloc arenas shared.

Everything the routes hand to `asyncio.to_thread` (media decode, schema and tool checks, message building) runs in
the loop's default executor. `install_pool` makes that a pool of `MSTAR_API_THREADS` threads (Python's own default
size unless set) whose threads all start at once, before the server takes requests: Python's executor starts a
thread on the submit that needs it, and `Thread.start` waits for the new thread to run, so on a busy machine each
such submit held the loop for a scheduling delay (0.1-0.24 s seen under the grammar stress).

A thread only frees the loop while the work in it lets go of the interpreter: one long C call (a JSON parse, a
base64 decode of megabytes) holds the GIL, and so the loop, for its whole length wherever it runs. Such work is made
cheaper or cut into pieces (`pieces.py`) as well as moved; large JSON bodies are parsed in the pool
(`json_bodies.py`). Small inputs stay inline: below `LARGE_BYTES` the hop to a thread costs more than the work.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mstar_core.errors import ConfigError
from mstar_core.strict import positive_number

#: Bodies and texts from this size go to the pool (a JSON parse of 256 KB takes ~1-2 ms here).
LARGE_BYTES = 256 * 1024
THREADS_ENV = "MSTAR_API_THREADS"


def pool_size() -> int:
    """Threads in the pool: `MSTAR_API_THREADS`, else what Python's own executor would use (CPUs + 4, at most 32)."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if raw:
        return int(positive_number(raw, THREADS_ENV, int))
    return min(32, (os.cpu_count() or 1) + 4)


#: glibc's mallopt parameter for the most malloc arenas (malloc.h), and the cap the server sets.
M_ARENA_MAX, ARENAS = -8, 2


def share_arenas() -> bool:
    """Cap glibc's malloc arenas (`ARENAS`), so the pool's threads share them instead of each keeping its own.

    The serving process keeps up to 256 MiB of freed heap per arena (`mstar_core.runtime.host_memory`: the device
    thread's forwards reuse their pages), and glibc gives each new thread an arena of its own, up to 8 per core:
    work spread over the pool's threads left each holding what it last decoded (RSS +722 MB after chaos_media's
    stress with the pool started whole, +311 MB with two arenas). Only glibc has mallopt; `MALLOC_ARENA_MAX` in the
    environment, or `MSTAR_MALLOC_TUNING=0`, leaves malloc as it is. True when applied."""
    if os.environ.get("MSTAR_MALLOC_TUNING", "1") == "0" or "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: nothing to cap
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_ARENA_MAX, ARENAS))


def release_freed_memory() -> None:
    """Hand freed heap back to the kernel (glibc's malloc_trim), after work that freed a lot at once (a realtime
    session's decoded media): arenas keep up to 256 MiB free otherwise. A few milliseconds; call it off the loop."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


#: Seconds a thread running Python keeps the GIL when another asks for it (Python's default: 5 ms). The loop asks
#: for it after every wait; with the pool's threads walking schemas meanwhile, each turn cost the loop up to 5 ms
#: per busy thread (a /health waited 95 ms behind six walks at load 4).
SWITCH_INTERVAL_S = 0.001


#: How much lower the pool's threads run than the loop and the device threads (Linux nice steps, per thread;
#: `MSTAR_API_THREAD_NICENESS`, 0 for none). On a machine with as many busy threads as cores, a 4096x4096 image
#: decoding in the pool took the core the loop needed to answer /health (`no-cpu` stalls of 76-150 ms in
#: chaos_media.py); a lower priority gives it the leftovers, and the loop and the other requests' steps come first.
POOL_NICENESS_ENV, POOL_NICENESS = "MSTAR_API_THREAD_NICENESS", 5


def pool_niceness() -> int:
    """`MSTAR_API_THREAD_NICENESS` (0-19), else `POOL_NICENESS`."""
    raw = os.environ.get(POOL_NICENESS_ENV, "").strip()
    if not raw:
        return POOL_NICENESS
    if not raw.isdigit() or int(raw) > 19:
        raise ConfigError(f"{POOL_NICENESS_ENV} must be a whole number from 0 to 19, got {raw!r}")
    return int(raw)


def _lower_this_thread(niceness: int) -> None:
    """This thread's own priority lowered by `niceness` (Linux applies a thread id's nice to that thread only)."""
    if niceness and sys.platform == "linux":
        tid = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + niceness)
        except OSError:  # (a sandbox may refuse: the pool then runs as the loop does)
            pass


def install_pool(loop: asyncio.AbstractEventLoop, threads: int | None = None) -> ThreadPoolExecutor:
    """Make a pool of `threads` threads the loop's default executor, every thread started now (their malloc arenas
    shared: `share_arenas`) at a lower priority than the loop (`POOL_NICENESS`), and the GIL handed on sooner
    (`SWITCH_INTERVAL_S`) when the loop waits for it."""
    share_arenas()
    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
    threads = threads or pool_size()
    niceness = pool_niceness()
    executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mstar-off-loop",
                                  initializer=_lower_this_thread, initargs=(niceness,))
    gate = threading.Barrier(threads)
    # each task waits for the others, so no thread is idle when the next is submitted: every submit starts one
    started = [executor.submit(gate.wait, 60) for _ in range(threads)]
    for future in started:
        future.result()
    loop.set_default_executor(executor)
    return executor


async def off_loop_when(needed: bool, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` in the pool when `needed` (the input can be large), else here: a thread hop costs a
    request more than the work it saves when there is nothing to walk (no schema, no tools)."""
    if needed:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)
