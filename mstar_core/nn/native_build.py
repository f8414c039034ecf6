"""The CPU kernels' instruction-set levels, and building every level of a kernel ahead of time (at package build).

A kernel source (`nn/*.cpp`, a plugin's `*.cpp`) tests compiler macros (`__AVX2__`, `__AVX512BF16__`, ...) to pick
its vector code. Installing the package builds it once per level whose macros it (or `mstar_native.h`) tests, plus
the portable floor, into `prebuilt/` beside the source; at run time `native.py` loads the highest level the CPU
has (`select_level`, a pure function of the CPU's flags), so a machine without a compiler runs the kernels too.
A library's name carries a digest of its source, the header and the level's flags: an edited source (an editable
install) finds no library of its digest and is built on first use instead, as before.

Standard library only: `setup.py` of mstar-core and of a plugin that ships a kernel load this file by its path,
before any package is importable (`cmdclass`).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

#: the folder beside a kernel's source that holds its prebuilt libraries
PREBUILT = "prebuilt"
#: the header every kernel may include (`#include "mstar_native.h"`), on every build's include path
HEADER = Path(__file__).with_name("mstar_native.h")
#: flags of every build, ahead of time or on first use. No fused multiply-add the source does not spell out:
#: kernels that round as torch's separate ops need each product rounded before it is added (explicit FMA
#: intrinsics stay FMAs)
COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
#: $MSTAR_PREBUILD_KERNELS=0 skips the build at install (kernels are then built on first use); parallel jobs:
#: $MSTAR_KERNEL_BUILD_JOBS (default: every core)
PREBUILD_ENV, JOBS_ENV = "MSTAR_PREBUILD_KERNELS", "MSTAR_KERNEL_BUILD_JOBS"


@dataclass(frozen=True)
class Level:
    """One instruction-set level: the compiler flags that build it, the CPU flags (as /proc/cpuinfo names them)
    that run it, and the macros a source tests that make this level's build differ from the one below."""

    name: str
    flags: tuple[str, ...]
    cpu_flags: frozenset[str]
    macros: tuple[str, ...]


def _levels() -> tuple[Level, ...]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return (Level("portable", (), frozenset(), ()),)  # (other machines: the compiler's default target)
    rows = [("portable", ("-march=x86-64",), (), ()),
            ("avx2", ("-mavx2", "-mfma", "-mf16c"), ("avx", "avx2", "fma", "f16c"), ("__AVX2__", "__FMA__", "__F16C__")),
            ("avx512", ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
             ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
             ("__AVX512F__", "__AVX512BW__", "__AVX512VL__", "__AVX512DQ__")),
            ("avx512bf16", ("-mavx512bf16", "-mavx512vnni"), ("avx512_bf16", "avx512_vnni"),
             ("__AVX512BF16__", "__AVX512VNNI__")),
            ("amx", ("-mamx-tile", "-mamx-bf16", "-mamx-int8"), ("amx_tile", "amx_bf16", "amx_int8"),
             ("__AMX_TILE__", "__AMX_BF16__", "__AMX_INT8__"))]
    levels, flags, needs = [], (), frozenset()
    for name, more_flags, more_needs, macros in rows:  # each level is the one below plus its own
        flags, needs = flags + more_flags, needs | frozenset(more_needs)
        levels.append(Level(name, flags, needs, macros))
    return tuple(levels)


#: the levels, lowest first; the first (portable) runs on any CPU of the machine type
LEVELS = _levels()
BY_NAME = {level.name: level for level in LEVELS}


def source_text(source: Path, header: Path = HEADER) -> bytes:
    """What a build of `source` reads: the source, and the shared header where it includes it."""
    text = source.read_bytes()
    return text + header.read_bytes() if header.name.encode() in text else text


def levels_for(text: bytes) -> list[str]:
    """The levels worth a build of a source: the floor, and each level whose macros the source tests."""
    return [LEVELS[0].name] + [lv.name for lv in LEVELS[1:] if any(m.encode() in text for m in lv.macros)]


def library_name(source: Path, level: str, text: bytes) -> str:
    """The prebuilt library's file name: its source, its level, and a digest of what it was built from."""
    digest = hashlib.sha256(text + " ".join(COMMON_FLAGS + BY_NAME[level].flags).encode()).hexdigest()[:16]
    return f"{source.stem}-{level}-{digest}.so"


def cpu_flags() -> frozenset[str]:
    """This CPU's flags as /proc/cpuinfo names them (empty where there is none: the portable level only)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def select_level(flags: frozenset[str] | set[str], built: list[str] | tuple[str, ...], cap: str | None = None) -> str | None:
    """The highest of the `built` levels a CPU with `flags` runs, no higher than `cap`; None if none is built."""
    best = None
    for level in LEVELS:
        if cap is not None and LEVELS.index(level) > LEVELS.index(BY_NAME[cap]):
            break
        if level.name in built and level.cpu_flags <= flags:
            best = level.name
    return best


def compiler() -> str | None:
    """The C++ compiler: $CXX, else `c++`, else `g++` (None: none on PATH)."""
    return shutil.which(os.environ.get("CXX", "c++")) or (None if "CXX" in os.environ else shutil.which("g++"))


def compile_library(cxx: str, source: Path, flags: list[str] | tuple[str, ...], target: Path,
                    header: Path = HEADER) -> None:
    """Build `source` into `target`, beside it first and renamed into place (a process loading it never sees
    half a file). Raises CalledProcessError (with the compiler's stderr) when it does not compile."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run([cxx, *COMMON_FLAGS, *flags, f"-I{header.parent}", str(source), "-o", str(built)],
                       capture_output=True, text=True, check=True)
        os.replace(built, target)


def prebuild(sources: list[Path], out: Path, header: Path = HEADER, jobs: int | None = None,
             say=print) -> list[Path]:
    """Build every level of every source into `out` (in parallel), drop the libraries of older versions there,
    and return the libraries. A level that does not compile (an older compiler) is skipped with a message, and
    without a compiler nothing is built: the kernels are then built on first use, or run as torch ops."""
    cxx = compiler()
    if cxx is None or os.environ.get(PREBUILD_ENV) == "0":
        say(f"mstar kernels: not prebuilt ({'no C++ compiler' if cxx is None else PREBUILD_ENV + '=0'}); "
            "they are built on first use where a compiler is, else run as torch ops")
        return []
    wanted = []
    for source in sources:
        text = source_text(source, header)
        wanted += [(source, level, out / library_name(source, level, text)) for level in levels_for(text)]

    def build(item):
        source, level, target = item
        if not target.exists():  # (a rebuild of the same version, an editable install again: nothing to do)
            try:
                compile_library(cxx, source, BY_NAME[level].flags, target, header)
            except (OSError, subprocess.CalledProcessError) as exc:
                say(f"mstar kernels: {source.stem} not prebuilt at {level}: {getattr(exc, 'stderr', '') or exc}")
                return None
        return target

    workers = jobs or int(os.environ.get(JOBS_ENV) or 0) or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        built = [path for path in pool.map(build, wanted) if path is not None]
    keep = {target.name for _, _, target in wanted}
    for source in sources:
        for stale in out.glob(f"{source.stem}-*.so"):
            if stale.name not in keep:
                stale.unlink(missing_ok=True)
    say(f"mstar kernels: prebuilt {len(built)} libraries ({', '.join(lv.name for lv in LEVELS)}) into {out}")
    return built


def cmdclass(packages: list[str], header: Path = HEADER) -> dict:
    """setuptools commands that build the kernels of `packages` (dotted names: their `*.cpp`) with the package:
    into the wheel's tree, or beside the sources for an editable install; and a wheel tagged for this platform
    (it holds machine code)."""
    from setuptools.command.build_py import build_py

    class build_py_with_kernels(build_py):
        def run(self):
            super().run()
            for package in packages:
                folder = Path(self.get_package_dir(package))
                out = folder if getattr(self, "editable_mode", False) else Path(self.build_lib, *package.split("."))
                prebuild(sorted(folder.glob("*.cpp")), out / PREBUILT, header)

    commands = {"build_py": build_py_with_kernels}
    try:
        from setuptools.command.bdist_wheel import bdist_wheel
    except ImportError:  # (setuptools < 70: the wheel package's own)
        try:
            from wheel.bdist_wheel import bdist_wheel
        except ImportError:
            return commands

    class bdist_platform_wheel(bdist_wheel):
        def get_tag(self):  # (the libraries are no Python extension: any Python 3 of this platform)
            pure, self.root_is_pure = self.root_is_pure, False
            try:
                return "py3", "none", super().get_tag()[2]
            finally:
                self.root_is_pure = pure

    commands["bdist_wheel"] = bdist_platform_wheel
    return commands
