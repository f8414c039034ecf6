"""Graceful drain under load: after SIGTERM the server still listens and answers new requests 503 (Retry-After),
every in-flight request finishes whole within --drain-timeout, then the process exits cleanly."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx

from tests.server.helpers import Server
from tests.server.toy.mstar_toy_models import SAMPLES_PER_CHUNK

CHARS = 40  # 40 chunks of 0.05 s: each request runs about 2 s


async def _scenario(srv: Server) -> tuple[list[int], list[httpx.Response]]:
    body = {"model": "toy-tts", "input": "x" * CHARS, "voice": "alpha", "response_format": "pcm"}
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
        async def full() -> int:
            async with client.stream("POST", "/v1/audio/speech", json=body) as resp:
                assert resp.status_code == 200
                return len(await resp.aread())

        in_flight = [asyncio.ensure_future(full()) for _ in range(6)]
        await asyncio.sleep(0.5)  # all six admitted and streaming
        srv.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        late = []
        for _ in range(3):  # new requests during the drain: refused, not reset
            late.append(await client.post("/v1/audio/speech", json=body))
            await asyncio.sleep(0.2)
        return list(await asyncio.gather(*in_flight)), late


def test_sigterm_under_load_finishes_every_request_and_refuses_new_ones():
    srv = Server(["toy-tts"], "--drain-timeout", "20", api_key=None, MSTAR_TOY_STEP_DELAY="0.05")
    try:
        sizes, late = asyncio.run(_scenario(srv))
        assert sizes == [CHARS * SAMPLES_PER_CHUNK * 2] * 6, "an in-flight response was lost or cut"
        for resp in late:
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"]["type"] == "server_shutting_down" and resp.headers["retry-after-ms"]
        deadline = time.monotonic() + 20
        while srv.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert srv.proc.returncode == 0, srv.output()[-3000:]
        assert "Traceback" not in srv.serving_output(), srv.serving_output()[-3000:]
    finally:
        srv.stop()
