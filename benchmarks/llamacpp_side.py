"""llama.cpp for the vs_llamacpp benchmark: its server built from source under the benchmark cache, and how it serves.

llama.cpp is never a dependency of M*. The source is the one `llama-cpp-python` vendors (its sdist, downloaded from
PyPI once), built with CMake for this machine (`GGML_NATIVE=ON`: every instruction set the CPU has), only the
`llama-server` target. The Hugging Face directory the benchmark serves is converted with the converter that ships in
the same source tree (`convert_hf_to_gguf.py`, its own `gguf-py` on the path), to a GGUF of the dtype M* serves.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
OUTTYPES = {"float32": "f32", "bfloat16": "bf16"}


def _root(cache: Path) -> Path:
    return cache / "llamacpp"


def _source(cache: Path, log=print) -> Path:
    """The vendored llama.cpp tree of the sdist, downloaded and unpacked once."""
    root = _root(cache)
    found = sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if found:
        return found[-1]
    root.mkdir(parents=True, exist_ok=True)
    log(f"downloading the {LLAMA_CPP_PYTHON} sdist (llama.cpp's vendored source) into {root}")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    LLAMA_CPP_PYTHON, "-d", str(root)], check=True)
    (sdist,) = root.glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(root, filter="data")
    return sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp"))[-1]


#: The build: native flags, server only, no network code (the model is a local file), static so the binary stands alone
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_OPENSSL=OFF",
               "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_BUILD_SERVER=ON")


def ensure_server(cache: Path, log=print, build: bool = True) -> tuple[Path, str, float]:
    """The `llama-server` binary, the source it was built from and the seconds building took now (0 if cached)."""
    src = _source(cache, log)
    version = src.parent.parent.name  # llama_cpp_python-X.Y.Z
    binary = _root(cache) / "build" / "bin" / "llama-server"
    marker = _root(cache) / ".built"
    if binary.exists() and marker.exists():
        return binary, version, 0.0
    if not build:
        raise RuntimeError(f"no llama-server at {binary}; run without --no-install to build it")
    t0 = time.perf_counter()
    jobs = str(os.cpu_count() or 1)
    log(f"building llama-server from {src} ({' '.join(CMAKE_FLAGS)}; once, several minutes)")
    build_dir = _root(cache) / "build"
    subprocess.run(["cmake", "-S", str(src), "-B", str(build_dir), *CMAKE_FLAGS], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", jobs], check=True,
                   stdout=subprocess.DEVNULL)
    marker.write_text(version + "\n")
    return binary, version, time.perf_counter() - t0


def convert(cache: Path, model_dir: Path, dtype: str, log=print) -> Path:
    """`model_dir` as a GGUF of `dtype`, written by llama.cpp's own converter (once per dtype)."""
    out = _root(cache) / f"{model_dir.name}-{OUTTYPES[dtype]}.gguf"
    if out.exists():
        return out
    src = _source(cache, log)
    tmp = out.with_suffix(".tmp")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src / "gguf-py"), os.environ.get("PYTHONPATH", "")])}
    log(f"converting {model_dir} to {out.name} with {src / 'convert_hf_to_gguf.py'}")
    subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outfile", str(tmp),
                    "--outtype", OUTTYPES[dtype]], check=True, env=env, stdout=subprocess.DEVNULL)
    shutil.move(tmp, out)
    return out


def server_command(binary: Path, gguf: Path, port: int, slots: int, ctx_per_slot: int, threads: int) -> list[str]:
    """llama-server as its README serves many clients: one slot per concurrent request (continuous batching is on
    by default), a context of `slots x ctx_per_slot`, every core for decode and for batches (prompt processing)."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--alias", "llama",
            "--parallel", str(slots), "--ctx-size", str(slots * ctx_per_slot), "--threads", str(threads),
            "--threads-batch", str(threads), "--no-webui", "--log-disable"]
