"""What the realtime tests share: the official client on a served model, synthetic audio, metrics reads."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import numpy as np

from tests.server.helpers import API_KEY

RATE = 24_000


def client(srv: Any) -> Any:
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=srv.url + "/v1", api_key=API_KEY)


def tone(seconds: float, amplitude: float = 0.3, freq: float = 220.0) -> np.ndarray:
    """A voiced-speech stand-in: a harmonic tone with a 4 Hz syllable envelope, int16 at 24 kHz."""
    t = np.arange(int(seconds * RATE)) / RATE
    voiced = sum(np.sin(2 * np.pi * freq * k * t) / k for k in range(1, 6))
    envelope = 0.6 + 0.4 * np.sin(2 * np.pi * 4 * t)
    return (amplitude * voiced / 2.3 * envelope * 32767).astype(np.int16)


def silence(seconds: float, noise: float = 0.0005, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(int(seconds * RATE)) * noise * 32767).astype(np.int16)


def b64(pcm: np.ndarray) -> str:
    return base64.b64encode(pcm.astype("<i2").tobytes()).decode()


def node_stat(srv: Any, model: str, node: str, stat: str) -> float:
    text = httpx.get(srv.url + "/metrics", headers=srv.headers, timeout=10).text
    for line in text.splitlines():
        if line.startswith("mstar_node_stat{") and f'model="{model}"' in line and f'node="{node}"' in line \
                and f'stat="{stat}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {stat} for {model}/{node} in /metrics")


async def until(conn: Any, kind: str, seen: list | None = None) -> Any:
    """Events up to and including the first of `kind` (an `error` event fails the test unless awaited)."""
    async for ev in conn:
        if seen is not None:
            seen.append(ev)
        if ev.type == kind:
            return ev
        assert ev.type != "error", ev.error
    raise AssertionError(f"connection closed before {kind}")


def types(events: list) -> list[str]:
    return [e.type for e in events]


def pages_used(srv: Any, model: str, node: str) -> float:
    return node_stat(srv, model, node, "kv_pages_used")


