"""Keep freed host memory mapped in this process (glibc), so forwards on the device thread stop page-faulting.

Models run on a device thread, which gets a malloc arena of its own. Under glibc's default adaptive thresholds
that arena hands the pages of a forward's large activations back to the kernel when they are freed, and the next
forward faults every one of them in again: for pi0's 556-token prefix, ~20,000 minor faults and ~70 ms of system
CPU per request that the same forward on the main thread does not pay. Fixing the thresholds (tensors up to
32 MiB from the heap, up to 256 MiB of free heap kept per arena) makes each forward reuse the pages of the last.
Memory is not lost: it is reused by the next forward instead of being unmapped and mapped again.

Only glibc has `mallopt`; elsewhere this does nothing. `MSTAR_MALLOC_TUNING=0`, or any of glibc's own
`MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` variables, leaves malloc as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's upper bound for the adaptive threshold (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 256 << 20

_done = False


def keep_freed_memory() -> bool:
    """Once per process: fix glibc's mmap and trim thresholds (see the module docstring). True when applied."""
    global _done
    if _done:
        return True
    if os.environ.get("MSTAR_MALLOC_TUNING", "1") == "0" or any(
            name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done
