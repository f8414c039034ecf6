"""Disaggregated tiny Orpheus behind the HTTP server while its codec worker is replaced (issue 31, item 5).

After the SNAC codec's worker is killed, new streamed speech requests sent during its replacement
must each get a 503 with Retry-After (the worker is down) or a complete 200 (the replacement is up),
never a 200 whose body is cut off after the LM's first tokens. The app runs in this process (uvicorn
on a loopback port) so the test kills exactly the codec's worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from pathlib import Path

import httpx
import pytest

from mstar_core.api.server.app import ModelToServe, ServerConfig, create_app
from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import load_placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from tests.cluster.helpers import until

pytest.importorskip("mstar_orpheus")
uvicorn = pytest.importorskip("uvicorn")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PLACEMENT = Path(__file__).resolve().parents[2] / "examples" / "placement" / "orpheus-disaggregated.yaml"
BODY = {"model": "orpheus", "input": "Hello from M star.", "voice": "tara", "seed": 7, "max_tokens": 140,
        "response_format": "pcm"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def served():
    """The app with disaggregated Orpheus on a loopback port: (client, engine)."""
    config = ServerConfig(models=[ModelToServe("orpheus", LoadOptions(preset="tiny"),
                                               placement=load_placement(PLACEMENT))])
    registry = discover()
    app = create_app(config, lambda: placed_engine(registry), registry=registry)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    task = asyncio.ensure_future(server.serve())
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120, trust_env=False) as client:
            deadline = time.monotonic() + 180
            while True:
                assert not task.done(), "the server stopped while loading"
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get("/health")).status_code == 200:
                        break
                assert time.monotonic() < deadline, "the server did not become healthy"
                await asyncio.sleep(0.2)
            yield client, app.state.mstar.engine
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 60)


async def speak(client: httpx.AsyncClient) -> dict:
    """One streamed speech request: its status, Retry-After, and whether its body arrived whole (with its size)."""
    try:
        async with client.stream("POST", "/v1/audio/speech", json=BODY) as r:
            body = b""
            try:
                async for data in r.aiter_raw():
                    body += data
                whole = True
            except httpx.HTTPError:  # the stream was cut off after the status line
                whole = False
            return {"status": r.status_code, "retry_after": r.headers.get("retry-after"), "whole": whole,
                    "bytes": len(body), "text": body[:300].decode(errors="replace") if r.status_code != 200 else ""}
    except httpx.HTTPError as exc:
        return {"status": None, "error": f"{type(exc).__name__}: {exc}"}


async def test_new_speech_requests_during_a_codec_replacement_get_503_or_a_whole_200():
    async with served() as (client, engine):
        reference = await speak(client)
        assert reference["status"] == 200 and reference["whole"] and reference["bytes"] > 0, reference
        codec = engine.cluster.workers["codec"]
        restarts = codec.restarts
        engine.cluster.kill("codec")

        async def later(delay: float) -> dict:
            await asyncio.sleep(delay)
            return {"sent_after_s": delay, **await speak(client)}

        # new requests every 0.1 s while the codec's worker is replaced (the first ones find it dead)
        results = await asyncio.gather(*(later(0.1 * i) for i in range(12)))
        await until(lambda: codec.ready and codec.restarts > restarts, 120, "the codec worker to be replaced")
        after = await speak(client)
    refused = [r for r in results if r["status"] == 503]
    served_whole = [r for r in results if r["status"] == 200 and r["whole"] and r["bytes"] == reference["bytes"]]
    assert len(refused) + len(served_whole) == len(results), results
    assert all(r["retry_after"] for r in refused), refused
    assert refused, f"no request hit the replacement window: {results}"
    assert all("worker" in r["text"] for r in refused), refused  # says the worker is down, not overload
    assert after["status"] == 200 and after["whole"] and after["bytes"] == reference["bytes"], after
