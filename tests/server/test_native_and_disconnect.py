"""The native endpoint over httpx; 64 streams with half disconnected mid-stream free every page."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import httpx
import numpy as np
import torch

from tests.server.helpers import metric
from tests.server.toy.mstar_toy_models import SAMPLES_PER_CHUNK


def test_native_walk_streams_ndjson_with_tensors(server):
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
    body = {"inputs": {"x": {"dtype": "float32", "shape": [3, 4], "data": base64.b64encode(x.numpy().tobytes()).decode()}}}
    with httpx.stream("POST", f"{server.url}/v1/walks/fixture-echo", json=body, headers=server.headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        events = [json.loads(line) for line in r.iter_lines() if line]
    assert [e["event"] for e in events] == ["output", "done"]
    assert events[0]["name"] == "y" and events[0]["walk"] == "echo"
    for value in (events[0]["value"], events[1]["outputs"]["y"]):
        assert value["dtype"] == "float32" and value["shape"] == [3, 4]
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(value["data"]), dtype=np.float32).reshape(3, 4), x.numpy())


def test_native_walk_non_streaming(server):
    r = httpx.post(f"{server.url}/v1/walks/toy-chat", headers=server.headers,
                   json={"inputs": {"messages": [{"role": "user", "content": "hi"}]}, "stream": False})
    assert r.status_code == 200 and r.json() == {"outputs": {"finish_reason": "stop"}}


async def test_64_streams_half_disconnected_free_all_pages(server):
    text = "x" * 40
    body = {"model": "toy-tts", "input": text, "voice": "alpha", "response_format": "pcm"}
    full = len(text) * SAMPLES_PER_CHUNK * 2

    async def one(client, drop: bool) -> int:
        got = 0
        async with client.stream("POST", "/v1/audio/speech", json=body) as resp:
            assert resp.status_code == 200
            async for data in resp.aiter_bytes():
                got += len(data)
                if drop and got >= 2 * SAMPLES_PER_CHUNK * 2:
                    return -got  # leaving the block closes the connection mid-stream
        return got

    calls_before = metric(server, "mstar_node_invocations", model="toy-tts", node="gen")
    busy_before = metric(server, "mstar_node_step_seconds_total", model="toy-tts", node="gen")
    started = time.monotonic()
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=60, limits=limits) as client:
        results = await asyncio.gather(*(one(client, i % 2 == 1) for i in range(64)))
    kept = [r for r in results if r >= 0]
    dropped = [-r for r in results if r < 0]
    assert len(kept) == 32 and all(r == full for r in kept)
    assert len(dropped) == 32 and all(r < full for r in dropped), "streams should be cut mid-way"
    for _ in range(50):
        if metric(server, "mstar_kv_pages_used", model="toy-tts", node="gen") == 0 and \
                metric(server, "mstar_running_requests") == 0:
            break
        await asyncio.sleep(0.1)
    assert metric(server, "mstar_kv_pages_used", model="toy-tts", node="gen") == 0
    assert metric(server, "mstar_kv_pages_free", model="toy-tts", node="gen") == 4096
    assert metric(server, "mstar_running_requests") == 0 and metric(server, "mstar_queue_depth") == 0
    # the dropped half was cancelled, not run to the end: far fewer than 64 x 40 chunk invocations
    calls = metric(server, "mstar_node_invocations", model="toy-tts", node="gen") - calls_before
    print(f"gen invocations: {calls:.0f} of {64 * len(text)} if nobody disconnected")
    assert 32 * len(text) <= calls < 0.85 * 64 * len(text), calls
    # the node's time inside steps counts up, and never past the wall time the streams took
    busy = metric(server, "mstar_node_step_seconds_total", model="toy-tts", node="gen") - busy_before
    assert 0 < busy <= time.monotonic() - started, busy
