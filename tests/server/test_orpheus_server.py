"""The tiny Orpheus model behind a real server: speech through the openai client (wav/pcm/SSE agree byte for byte
for the same seed), 64 streams with half disconnected leave the KV pool fully free, and bench serve reports."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
import sys

import httpx
import numpy as np
import pytest
import soundfile

from tests.server.helpers import Server, metric, server_env

pytest.importorskip("mstar_orpheus")
pytest.importorskip("mstar_kvcache")

pytestmark = pytest.mark.slow  # a real (tiny) Llama + SNAC on 2 shared CPU cores


@pytest.fixture(scope="module")
def orpheus(tmp_path_factory):
    deploy = tmp_path_factory.mktemp("deploy") / "deploy.yaml"
    deploy.write_text("models:\n  orpheus:\n    preset: tiny\n    engines:\n      lm: {num_pages: 2048}\n")
    srv = Server([], "--config", str(deploy))
    yield srv
    srv.stop()


def speech(srv, fmt, **extra):
    from openai import OpenAI

    client = OpenAI(base_url=f"{srv.url}/v1", api_key=srv.api_key, max_retries=0, timeout=120)
    body = {"max_tokens": 160, "seed": 7, **extra}
    return client.audio.speech.create(model="orpheus", voice="tara", input="Hello from M star", response_format=fmt,
                                      extra_body=body).content


def test_orpheus_speech_formats_agree(orpheus):
    pcm = np.frombuffer(speech(orpheus, "pcm"), dtype="<i2")
    assert pcm.size > 0, "the tiny model should emit some audio within 160 tokens"
    decoded, rate = soundfile.read(io.BytesIO(speech(orpheus, "wav", stream=False)), dtype="int16")
    assert rate == 24000
    np.testing.assert_array_equal(decoded, pcm)
    body = {"model": "orpheus", "voice": "tara", "input": "Hello from M star", "response_format": "pcm",
            "stream_format": "sse", "max_tokens": 160, "seed": 7}
    with httpx.stream("POST", f"{orpheus.url}/v1/audio/speech", json=body, headers=orpheus.headers, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    sse = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    np.testing.assert_array_equal(np.frombuffer(sse, dtype="<i2"), pcm)
    usage = events[-1]["usage"]
    assert events[-1]["type"] == "speech.audio.done" and usage["input_tokens"] > 0
    assert 0 < usage["output_tokens"] <= 161  # max_tokens plus the stop token


async def test_orpheus_64_streams_half_disconnected_pool_returns_free(orpheus):
    body = {"model": "orpheus", "input": "Streaming speech for everyone", "voice": "leo", "response_format": "pcm",
            "max_tokens": 120}

    async def one(client, i):
        got = 0
        async with client.stream("POST", "/v1/audio/speech", json=dict(body, seed=i)) as resp:
            assert resp.status_code == 200
            async for data in resp.aiter_bytes():
                got += len(data)
                if i % 2:
                    return None  # drop the connection at the first audio
        return got

    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=orpheus.url, headers=orpheus.headers, timeout=300, limits=limits) as client:
        results = await asyncio.gather(*(one(client, i) for i in range(64)))
    assert sum(r is None for r in results) <= 32 and sum(r is not None for r in results) >= 32
    for _ in range(100):
        if metric(orpheus, "mstar_kv_pages_used", model="orpheus", node="lm") == 0:
            break
        await asyncio.sleep(0.1)
    assert metric(orpheus, "mstar_kv_pages_used", model="orpheus", node="lm") == 0
    assert metric(orpheus, "mstar_running_requests") == 0 and metric(orpheus, "mstar_queue_depth") == 0


def test_bench_serve_against_tiny_orpheus(orpheus):
    out = subprocess.run([sys.executable, "-m", "mstar_core.cli", "bench", "serve", "--url", orpheus.url,
                          "--api-key", orpheus.api_key, "--model", "orpheus", "--kind", "speech", "--voice", "tara",
                          "--concurrency", "4", "--num-requests", "8"],
                         capture_output=True, text=True, env=server_env(), timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    print(out.stdout)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["succeeded"] == 8 and report["audio_s_total"] > 0
    assert report["ttfa_s"]["p50"] > 0 and report["rtf"]["p50"] > 0
    assert "TTFA" in out.stdout and "audio-s/s" in out.stdout
