"""Small C++ CPU kernels built once per machine and loaded through ctypes (no torch headers, no build step at install).

A kernel source is plain C ABI over raw pointers; `c++ -O3 -march=native -fopenmp` builds it in about a
second into `$MSTAR_KERNEL_CACHE` (default `~/.cache/mstar/kernels`), named by a hash of the source,
the flags, the compiler and the CPU's flags, so a machine builds each version once and every process
after loads it. OpenMP inside a kernel resolves to the runtime torch already loaded (the same
`libgomp.so.1` soname, or Intel's preloaded over both). Without a compiler a kernel is None and its
callers keep their torch ops; `MSTAR_NATIVE_KERNELS=0` turns every kernel off, `avx2` builds them without
AVX-512 and `portable` without AVX2 or FMA either (what such CPUs run: the tests compare the builds).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger("mstar.nn.native")

SWITCH_ENV = "MSTAR_NATIVE_KERNELS"  # "native" (default), "avx2", "portable" or "0"
CACHE_ENV = "MSTAR_KERNEL_CACHE"
#: compiler flags per build variant
FLAGS = {"native": ["-march=native"], "avx2": ["-march=native", "-mno-avx512f"],
         "portable": ["-march=native", "-mno-avx2", "-mno-fma"]}
#: the header every kernel may include (`#include "mstar_native.h"`): bf16 conversions, exp
HEADER = Path(__file__).with_name("mstar_native.h")

#: The tapes recording (tape.py), while any thread records, else None: every kernel wrapper hands it the call it just made
RECORDER: Any = None

_lock = threading.Lock()
# libraries by (source, variant) and entry points (signature set) by (source, variant, name); None: not built
_loaded: dict[tuple, Any] = {}


def variant_from_env() -> str | None:
    """The build variant $MSTAR_NATIVE_KERNELS asks for, or None when kernels are off."""
    setting = os.environ.get(SWITCH_ENV, "native")
    if setting == "0":
        return None
    if setting not in FLAGS:
        raise ValueError(f"{SWITCH_ENV} must be 0, native, avx2 or portable, got {setting!r}")
    return setting


def load(source: Path, variant: str | None = None) -> ctypes.CDLL | None:
    """The library built from `source` (`variant`: default from the environment), or None where it cannot be built."""
    variant = variant_from_env() if variant is None else variant
    if variant is None:
        return None
    key = (str(source), variant)
    if key in _loaded:  # (the hot path: kernels are looked up every layer of every step)
        return _loaded[key]
    with _lock:
        if key not in _loaded:
            _loaded[key] = _build_and_load(source, variant)
        return _loaded[key]


def function(source: Path, name: str, argtypes: list, restype: Any, variant: str | None = None):
    """Entry point `name` of `source`'s library with its C signature set, or None where the library is not built."""
    variant = variant_from_env() if variant is None else variant
    if variant is None:
        return None
    key = (source, variant, name)
    found = _loaded.get(key, _loaded)  # (the hot path: one lookup per kernel call, every layer of every step)
    if found is not _loaded:
        return found
    lib = load(source, variant)
    fn = None if lib is None else getattr(lib, name)  # (ctypes keeps the function object on the library)
    if fn is not None:
        fn.argtypes, fn.restype = argtypes, restype
    _loaded[key] = fn
    return fn


def linear_runner(entry, dtype, label: str, scaled: bool = False):
    """`run(rows, packed, out_features, bias) -> out` over a packed-linear entry point, resolved once (None: no entry).

    The entry points of `fp32_linear.cpp`, `bf16_linear.cpp` and `amx_linear.cpp` share one C signature; a
    `PackedLinear` keeps its runner, so the 121 calls of a decode step look nothing up. `scaled`: an int8 entry
    point, which takes one fp32 scale per output after the packed weight (`run(..., bias, scale)`).
    """
    import torch  # (here: building and loading kernels needs no torch)

    if entry is None:
        return None
    empty, threads = torch.empty, torch.get_num_threads

    def run(rows, packed, out_features: int, bias, scale=None):
        count, inner = rows.shape
        out = empty((count, out_features), dtype=dtype)
        args = (rows.data_ptr(), rows.stride(0), packed.data_ptr(), *((scale.data_ptr(),) if scaled else ()),
                None if bias is None else bias.data_ptr(), out.data_ptr(), out_features, count, out_features, inner,
                threads())
        failed = entry(*args)
        if failed:
            raise RuntimeError(f"{label} refused the call (code {failed}: not built for this CPU, or no memory)")
        if RECORDER is not None:
            RECORDER.record(entry, args)
        return out

    return run


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build_and_load(source: Path, variant: str) -> ctypes.CDLL | None:
    compiler = shutil.which(os.environ.get("CXX", "c++")) or (None if "CXX" in os.environ else shutil.which("g++"))
    if compiler is None:
        log.warning("no C++ compiler (%s): %s runs as torch ops", os.environ.get("CXX", "c++"), source.stem)
        return None
    try:
        return ctypes.CDLL(str(_build(compiler, source, variant)))
    except (OSError, subprocess.CalledProcessError) as exc:
        log.warning("%s not built (%s): it runs as torch ops", source.stem, getattr(exc, "stderr", "") or exc)
        return None


@functools.cache
def _compiler_version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout


def _build(compiler: str, source: Path, variant: str) -> Path:
    # no fused multiply-add the source does not spell out: kernels that round as torch's separate ops need each
    # product rounded before it is added (explicit FMA intrinsics stay FMAs)
    flags = ["-O3", *FLAGS[variant], "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", f"-I{HEADER.parent}"]
    version = _compiler_version(compiler)
    digest = hashlib.sha256(source.read_bytes() + HEADER.read_bytes() + " ".join(flags).encode() + version.encode()
                            + _cpu_flags().encode())
    folder = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mstar" / "kernels")
    target = folder / f"{source.stem}-{variant}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    # built beside the target and renamed into place: processes building at once never load half a file
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        built = Path(scratch) / target.name
        subprocess.run([compiler, *flags, str(source), "-o", str(built)], capture_output=True, text=True, check=True)
        os.replace(built, target)
    for stale in folder.glob(f"{source.stem}-{variant}-*.so"):  # earlier versions (unlinking a loaded one is safe)
        if stale != target:
            stale.unlink(missing_ok=True)
    return target
