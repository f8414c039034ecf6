"""A real `mstar serve` process on loopback, serving the toy models (and fixture-echo) behind an API key."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

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
    env.update(extra)
    return env


class Server:
    def __init__(self, models: list[str], *args: str, api_key: str | None = API_KEY, **env: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "mstar_core.cli", "serve", *models, "--plugin", "mstar_toy_models",
               "--port", str(self.port), "--log-level", "warning", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"mstar-server-{self.port}.log", "w+")
        self.proc = subprocess.Popen(cmd, env=server_env(**env), stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
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


@pytest.fixture(scope="session")
def server():
    srv = Server(["toy-tts", "toy-chat", "toy-image", "fixture-echo"], MSTAR_TOY_STEP_DELAY="0.002")
    yield srv
    code = srv.stop()
    assert code == 0, f"server did not shut down cleanly (exit {code}):\n{srv.output()[-3000:]}"
    assert "Traceback" not in srv.serving_output(), srv.serving_output()[-3000:]


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


@pytest.fixture(scope="session")
def edge_server():
    """The toy models plus the tiny llama and orpheus presets: every route and the native endpoint over real
    `prepare` code (SamplingParams included), for the edge validation and fuzz tests."""
    pytest.importorskip("mstar_llm")
    pytest.importorskip("mstar_orpheus")
    srv = Server(["llama", "orpheus", "toy-tts", "toy-chat", "toy-image", "fixture-echo"],
                 MSTAR_TOY_STEP_DELAY="0.002")
    yield srv
    code = srv.stop()
    assert code == 0, f"server did not shut down cleanly (exit {code}):\n{srv.output()[-3000:]}"
    # no request may leave a traceback (what plugins logged while loading is not the edge's business)
    assert "Traceback" not in srv.serving_output(), srv.serving_output()[-3000:]
