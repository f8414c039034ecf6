"""A real `mstar serve` process on loopback (`Server`) and what tests read from it; shared by every served test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

TOY_DIR = Path(__file__).parent / "toy"
API_KEY = "test-key-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TOY_DIR), env.get("PYTHONPATH", "")])
    env["HF_HUB_OFFLINE"] = "1"
    env.pop("MSTAR_API_KEY", None)
    # each server its own Batch API state (a test that restarts one passes --state-dir), never the user's
    env["MSTAR_STATE_DIR"] = tempfile.mkdtemp(prefix="mstar-test-state-")
    env.update(extra)
    return env


class Server:
    """`mstar serve MODELS` on a free port; `wait=False` returns at once (boot beside other work, then `wait_ready`)."""

    def __init__(self, models: list[str], *args: str, api_key: str | None = API_KEY,
                 plugins: tuple[str, ...] = ("mstar_toy_models",), wait: bool = True, **env: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "mstar_core.cli", "serve", *models, "--port", str(self.port),
               "--log-level", "warning", *args]
        for plugin in plugins:
            cmd += ["--plugin", plugin]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"mstar-server-{self.port}.log", "w+")
        self.proc = subprocess.Popen(cmd, env=server_env(**env), stdout=self.log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 60) -> None:
        """Return once /health answers; stop the server and raise with its log if it exits or times out."""
        # a box loaded by other jobs starts servers several times slower: MSTAR_TEST_START_SCALE stretches every wait
        deadline = time.monotonic() + timeout * float(os.environ.get("MSTAR_TEST_START_SCALE", "1"))
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    self.ready_at = len(self.output())
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.output()}")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def serving_output(self) -> str:
        """What the server logged since it became healthy (startup warnings, e.g. broken plugins, excluded)."""
        return self.output()[self.ready_at:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode



def metric(server: Server, name: str, **labels: str) -> float:
    """One sample of a Prometheus metric from /metrics (0 when absent)."""
    text = httpx.get(f"{server.url}/metrics", headers=server.headers).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    total = 0.0
    for line in text.split("\n"):  # the exposition format's only line break (splitlines() knows more)
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, _, value = line.rpartition(" ")
            got = key[len(name):].strip("{}")
            if all(part in got.split(",") for part in want.split(",") if part):
                total += float(value)
    return total
