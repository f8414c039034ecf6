"""Small C++ CPU kernels loaded through ctypes (no torch headers): prebuilt per instruction set, else built on first use.

A kernel source is plain C ABI over raw pointers. Installing the package builds it once per instruction-set level
its `#if`s test (portable, avx2, avx512, avx512bf16, amx: `native_build.py`) into `prebuilt/` beside it, and a
process loads the highest level this CPU runs, so a machine without a compiler has the kernels too. Where none
is prebuilt for the source's version (an sdist installed without a compiler, a source edited in an editable
install), `c++ -O3 -march=native -fopenmp` builds it in about a second into `$MSTAR_KERNEL_CACHE` (default
`~/.cache/mstar/kernels`), named by a hash of the source, the flags, the compiler and the CPU's flags, so a
machine builds each version once and every process after loads it. OpenMP inside a kernel resolves to the
runtime torch already loaded (the same `libgomp.so.1` soname, or Intel's preloaded over both). With neither a
kernel is None and its callers keep their torch ops. `MSTAR_NATIVE_KERNELS`: `native` (default) the best
prebuilt level, `avx2` / `portable` (or `avx512`, `avx512bf16`, `amx`) no higher than that level (what such
CPUs run: the tests compare the builds), `jit` always the first-use build, `0` every kernel off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

from mstar_core.nn import native_build

log = logging.getLogger("mstar.nn.native")

SWITCH_ENV = "MSTAR_NATIVE_KERNELS"  # "native" (default), "jit", a level of native_build.LEVELS, or "0"
CACHE_ENV = "MSTAR_KERNEL_CACHE"
#: compiler flags of the first-use build per variant (a level: -march=native without the instructions above it)
_NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
FLAGS = {"native": ["-march=native"], "jit": ["-march=native"], "amx": ["-march=native"],
         "avx512bf16": ["-march=native", *_NO_AMX],
         "avx512": ["-march=native", "-mno-avx512bf16", "-mno-avx512vnni", *_NO_AMX],
         "avx2": ["-march=native", "-mno-avx512f"],
         "portable": ["-march=native", "-mno-avx2", "-mno-fma"]}
#: the header every kernel may include (`#include "mstar_native.h"`): bf16 conversions, exp
HEADER = native_build.HEADER

#: The tapes recording (tape.py), while any thread records, else None: every kernel wrapper hands it the call it just made
RECORDER: Any = None

_lock = threading.Lock()
# libraries by (source, variant) and entry points (signature set) by (source, variant, name); None: not built
_loaded: dict[tuple, Any] = {}
# how each library loaded: (source stem, variant) -> (level, build) with build "prebuilt", "jit" or "none"
_how: dict[tuple[str, str], tuple[str, str]] = {}


# os.environ's own table (bytes to bytes on POSIX), read directly: the kernel wrappers ask for the setting on every call
# (ten times a layer of a prompt step), and os.environ.get's key encoding and value decoding took ~1 us of it each
_ENVIRON_TABLE = getattr(os.environ, "_data", None) if os.name == "posix" else None
_SWITCH_KEY = os.fsencode(SWITCH_ENV)
_variants: dict = {}  # the setting as read -> its variant (a valid one: checked on its first read)


def variant_from_env() -> str | None:
    """The build variant $MSTAR_NATIVE_KERNELS asks for, or None when kernels are off."""
    raw = _ENVIRON_TABLE.get(_SWITCH_KEY) if _ENVIRON_TABLE is not None else os.environ.get(SWITCH_ENV)
    try:
        return _variants[raw]
    except KeyError:
        pass
    setting = os.environ.get(SWITCH_ENV, "native")
    if setting == "0":
        variant = None
    elif setting not in FLAGS:
        raise ValueError(f"{SWITCH_ENV} must be 0, native, jit, {', '.join(native_build.BY_NAME)}, got {setting!r}")
    else:
        variant = setting
    _variants[raw] = variant
    return variant


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
            _loaded[key] = _load_prebuilt(source, variant) or _build_and_load(source, variant)
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


def linear_runner(entry, dtype, label: str, scaled: bool = False, task_bytes=None):
    """`run(rows, packed, out_features, bias) -> out` over a packed-linear entry point, resolved once (None: no entry).

    The entry points of `fp32_linear.cpp`, `bf16_linear.cpp` and `amx_linear.cpp` share one C signature; a
    `PackedLinear` keeps its runner, so the 121 calls of a decode step look nothing up. `scaled`: an int8 entry
    point, which takes one fp32 scale per output after the packed weight (`run(..., bias, scale)`). The last
    argument, a hint naming the next call's weight, is null here: a tape recording the call fills it in
    (`tape.py`), told the weight's address and `task_bytes(n, k, element bytes, threads)` (the panel kernels'; None:
    the kernel takes no hint).
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
                threads(), None)
        failed = entry(*args)
        if failed:
            raise RuntimeError(f"{label} refused the call (code {failed}: not built for this CPU, or no memory)")
        if RECORDER is not None:
            stride = 0 if task_bytes is None else task_bytes(out_features, inner, packed.element_size(), args[-2])
            RECORDER.record(entry, args, weight=(packed.data_ptr(), stride))
        return out

    return run


def active() -> dict[str, tuple[str, str]]:
    """The kernels this process has loaded so far: source stem -> (level, build), build "prebuilt" (`level`: the
    instruction set it was built for), "jit" (built here on first use with -march=native: `level` native, or
    the level the setting caps it at) or "none" (torch ops run instead: `level` none); for the variant $MSTAR_NATIVE_KERNELS names (tests load others beside it)."""
    setting = os.environ.get(SWITCH_ENV, "native")
    return {stem: how for (stem, variant), how in sorted(_how.items()) if variant == setting}


def summary() -> str:
    """One line for the server banner: the kernels loaded so far and how (the rest load on first use), and
    whether this CPU's level is prebuilt for the core's kernels."""
    setting = os.environ.get(SWITCH_ENV, "native")
    if setting == "0" or setting not in FLAGS:
        return f"native kernels: off ({SWITCH_ENV}={setting}): torch ops"
    shown = {"prebuilt": "{level}", "jit": "built here (-march={level})", "none": "torch ops"}
    loaded = ", ".join(f"{stem} {shown[build].format(level=level)}" for stem, (level, build) in active().items())
    sources = sorted(Path(__file__).parent.glob("*.cpp"))
    ready = sum(_prebuilt_library(source, setting) is not None for source in sources)
    best = native_build.select_level(_cpu_flags(), list(native_build.BY_NAME))
    return (f"native kernels ({SWITCH_ENV}={setting}; CPU level {best}; {ready} of {len(sources)} core kernels "
            f"prebuilt for it): {loaded or 'none loaded yet'}")


@functools.cache
def _cpu_flags() -> frozenset[str]:
    return native_build.cpu_flags()


def _prebuilt_library(source: Path, variant: str) -> tuple[str, Path] | None:
    """The level and path of `source`'s prebuilt library (its version) at the best level this CPU runs, no
    higher than a level `variant` names; None where none is (or `variant` is jit)."""
    folder = source.parent / native_build.PREBUILT
    if variant == "jit" or not folder.is_dir():
        return None
    text = native_build.source_text(source, HEADER)
    built = {level: folder / native_build.library_name(source, level, text) for level in native_build.levels_for(text)}
    built = {level: path for level, path in built.items() if path.exists()}
    cap = variant if variant in native_build.BY_NAME else None  # (native, or a level this machine type lacks)
    level = native_build.select_level(_cpu_flags(), list(built), cap)
    return None if level is None else (level, built[level])


def _load_prebuilt(source: Path, variant: str) -> ctypes.CDLL | None:
    found = _prebuilt_library(source, variant)
    if found is None:
        return None
    level, path = found
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        log.warning("prebuilt %s (%s) did not load (%s): building it here", source.stem, level, exc)
        return None
    _how[(source.stem, variant)] = (level, "prebuilt")
    return lib


def _build_and_load(source: Path, variant: str) -> ctypes.CDLL | None:
    _how[(source.stem, variant)] = ("none", "none")
    compiler = native_build.compiler()
    if compiler is None:
        log.warning("no C++ compiler (%s) and no prebuilt library: %s runs as torch ops",
                    os.environ.get("CXX", "c++"), source.stem)
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler, source, variant)))
    except (OSError, subprocess.CalledProcessError) as exc:
        log.warning("%s not built (%s): it runs as torch ops", source.stem, getattr(exc, "stderr", "") or exc)
        return None
    _how[(source.stem, variant)] = ("native" if variant == "jit" else variant, "jit")  # (-march=native, capped)
    return lib


@functools.cache
def _compiler_version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout


def _build(compiler: str, source: Path, variant: str) -> Path:
    flags = [*native_build.COMMON_FLAGS, *FLAGS[variant]]
    version = _compiler_version(compiler)
    digest = hashlib.sha256(source.read_bytes() + HEADER.read_bytes() + " ".join(flags).encode() + version.encode()
                            + " ".join(sorted(_cpu_flags())).encode())
    folder = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mstar" / "kernels")
    target = folder / f"{source.stem}-{variant}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    native_build.compile_library(compiler, source, FLAGS[variant], target, HEADER)
    for stale in folder.glob(f"{source.stem}-{variant}-*.so"):  # earlier versions (unlinking a loaded one is safe)
        if stale != target:
            stale.unlink(missing_ok=True)
    return target
