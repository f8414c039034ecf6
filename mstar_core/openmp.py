"""Run a serving process on Intel's OpenMP runtime where it is installed, with huge pages for malloc's large blocks.

torch's CPU wheel links GNU OpenMP. Served SmolLM2-135M in bf16 on 2 cores ran 17 tok/s at c=1 and 107
at c=8 on it, against 32-35 and 165-185 with Intel's runtime preloaded, whose workers spin between
parallel regions for a block time (`KMP_BLOCKTIME`; with it at 0 the gain is gone); the engine alone,
stepped from one thread on GNU OpenMP, already ran at the faster speed (BENCHMARKS.md, issue 25). `GOMP_SPINCOUNT` did not help, which fits
GNU OpenMP's throttled spin once it counts more team threads than cores (a server has several threads
that run torch ops), so a decode step's few hundred regions each wake their worker through a futex.
vLLM's CPU build documents the same preload. A process can only change its OpenMP runtime before
torch loads, so the `mstar` command re-executes itself once with `LD_PRELOAD` set;
`MSTAR_OPENMP=gnu` keeps torch's own runtime.

The re-executed process also asks glibc's malloc for transparent huge pages on its large blocks
(`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, glibc 2.35+; older ones ignore it; a setting of the caller's
is kept): a decode step streams every weight once, and with 2 MiB pages its TLB misses and a grown KV
lane store's page faults are 512 times fewer. `benchmarks/decode_linears.py` with and without it (2 cores,
THP in `madvise` mode): oneDNN's bf16 step at 2 rows 14.1-14.4 -> 13.5-14.0 ms, at 32 rows 16.8-17.3 ->
16.2-16.5 ms; the AMX tiles within 3 %.

tcmalloc is not preloaded, though vLLM's CPU docs preload it: it replaces glibc's malloc, so the tunable no
longer applies and no weight lands in a huge page. On a 2-core AMD EPYC (Zen 5, AVX512-BF16) a served SmolLM2
step at c=1 read 11.2 ms in bf16 and 17.5 ms in fp32 with tcmalloc (0 kB of huge pages), 9.8-10.1 and 13.3-14.0
ms without it (1.8 / 3.3 GB in 2 MiB pages).

Huge pages pay for what loading puts in memory (weights, the KV pool), not for request-time buffers: with THP
defrag in `madvise` mode a madvised fault may compact memory synchronously, and a 4096x4096 image's 48 MB
buffers held the whole serving process for 130-320 ms at a time (`/health` stalls under chaos_media.py; none
with the tunable off, BENCHMARKS.md issue 50). So once the models are in, the serving process turns THP off for
its later faults (`prctl(PR_SET_THP_DISABLE)`: pages already huge stay huge; processes it starts after that
inherit the setting, so a worker process turns them back on before it loads: `allow_huge_pages`).
`MSTAR_HUGE_PAGES_AFTER_LOAD=1` keeps them on.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import sys
from collections.abc import Sequence

MODE_ENV = "MSTAR_OPENMP"  # "auto" (default) or "gnu"
REEXEC_ENV = "MSTAR_OPENMP_PRELOADED"  # set on the re-executed process, so it never loops
TUNABLES_ENV = "GLIBC_TUNABLES"
HUGE_PAGES = "glibc.malloc.hugetlb=1"  # madvise(MADV_HUGEPAGE) on malloc's mmapped blocks
AFTER_LOAD_ENV = "MSTAR_HUGE_PAGES_AFTER_LOAD"  # "1" keeps THP for faults after the models are loaded
PR_SET_THP_DISABLE, PR_GET_THP_DISABLE = 41, 42

log = logging.getLogger("mstar.openmp")


def libraries() -> list[str]:
    """Intel OpenMP (the `intel-openmp` wheel's, else the system's), where found."""
    for pattern in (f"{sys.prefix}/lib/libiomp5.so", "/usr/lib/x86_64-linux-gnu/libiomp5.so*"):
        hit = sorted(glob.glob(pattern))
        if hit:
            return [hit[0]]
    return []


def preload_env(environ: dict[str, str]) -> dict[str, str] | None:
    """The environment to re-execute with, or None where there is nothing to change."""
    if environ.get(MODE_ENV, "auto") == "gnu" or environ.get(REEXEC_ENV) or not sys.platform.startswith("linux"):
        return None
    if environ.get(MODE_ENV, "auto") != "auto":
        raise SystemExit(f"mstar: {MODE_ENV} must be 'auto' or 'gnu', got {environ[MODE_ENV]!r}")
    present = environ.get("LD_PRELOAD", "")
    wanted = [lib for lib in libraries() if os.path.basename(lib).split(".")[0] not in present]
    if not wanted:
        return None
    tunables = environ.get(TUNABLES_ENV, "")
    if "glibc.malloc.hugetlb" not in tunables:
        tunables = ":".join(filter(None, [tunables, HUGE_PAGES]))
    return {**environ, "LD_PRELOAD": ":".join([*wanted, *filter(None, [present])]), REEXEC_ENV: "1",
            TUNABLES_ENV: tunables}


def reexec_with_intel_openmp(argv: Sequence[str]) -> None:
    """Replace this process by itself on Intel OpenMP (no return), unless it has nothing to change."""
    if "torch" in sys.modules:  # too late: this process already chose its runtime
        return
    env = preload_env(dict(os.environ))
    if env is not None:
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "mstar_core.cli", *argv], env)


def stop_huge_pages_after_load(environ: dict[str, str] | None = None) -> bool:
    """Turn transparent huge pages off for this process's faults from now on; True where it did.

    Called once the models are loaded: request-time buffers then fault in 4 KiB pages, never a synchronous
    compaction, while the weights and the KV pool keep the huge pages they were loaded into."""
    environ = os.environ if environ is None else environ
    if environ.get(AFTER_LOAD_ENV, "0") == "1" or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0:
        log.info("could not turn transparent huge pages off after loading (errno %d)", ctypes.get_errno())
        return False
    return True


def allow_huge_pages() -> None:
    """Turn transparent huge pages back on for this process: a worker the server starts after loading its models
    (a replacement) inherits their being off across fork and exec, and its weights should load into them."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_THP_DISABLE, 0, 0, 0, 0)


def huge_pages_stopped() -> bool:
    """Whether this process has transparent huge pages turned off (`PR_GET_THP_DISABLE`)."""
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0) == 1
