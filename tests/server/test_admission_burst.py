"""Admission is exact: a burst against --max-running 4 --max-queued 4 is refused exactly past 8, whatever its timing."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from mstar_core.runtime.admission import Admission, AtCapacity
from tests.server.helpers import Server

BURST = 200
RUNNING, QUEUED = 4, 4


def test_places_are_taken_and_given_back_exactly():
    adm = Admission(2, 1)
    places = [adm.take() for _ in range(3)]
    with pytest.raises(AtCapacity):
        adm.take()
    places[0].start()
    assert (adm.running, adm.waiting) == (1, 2)
    places[0].release()
    places[0].release()  # idempotent: a second give-back frees nothing more
    assert (adm.running, adm.waiting) == (0, 2)
    adm.take()
    with pytest.raises(AtCapacity):
        adm.take()


@pytest.fixture(scope="module")
def burst_server():
    # every chunk takes 0.05 s and a request is 60 chunks (3 s): the burst is over long before a place frees
    srv = Server(["toy-tts"], "--max-running", str(RUNNING), "--max-queued", str(QUEUED), api_key=None,
                 MSTAR_TOY_STEP_DELAY="0.05")
    yield srv
    srv.stop()


async def _burst(url: str, stream: bool) -> list[httpx.Response]:
    body = {"model": "toy-tts", "input": "x" * 60, "voice": "alpha", "response_format": "pcm"}
    limits = httpx.Limits(max_connections=BURST + 8, max_keepalive_connections=BURST + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        async def one():
            if not stream:
                return await client.post("/v1/audio/speech", json=body)
            async with client.stream("POST", "/v1/audio/speech", json={**body, "stream": True}) as resp:
                await resp.aread()
                return resp
        return await asyncio.gather(*(one() for _ in range(BURST)))


@pytest.mark.parametrize("stream", [False, True])
def test_burst_of_200_gets_exactly_192_refusals(burst_server, stream):
    responses = asyncio.run(_burst(burst_server.url, stream))
    statuses = [r.status_code for r in responses]
    refused = [r for r in responses if r.status_code == 503]
    assert len(refused) == BURST - RUNNING - QUEUED, sorted(set(statuses))
    assert statuses.count(200) == RUNNING + QUEUED
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1 and int(r.headers["retry-after-ms"]) >= 1
        assert r.json()["error"]["type"] == "server_overloaded"
    # every place came back: the next request is admitted and served
    again = httpx.post(f"{burst_server.url}/v1/audio/speech", timeout=60,
                       json={"model": "toy-tts", "input": "ok", "voice": "alpha"})
    assert again.status_code == 200, again.text
