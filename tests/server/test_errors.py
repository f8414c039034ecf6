"""Bad input gets a 4xx in OpenAI's error shape that says what to fix; auth; body limit; 503 when full."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.server.helpers import Server


def post(server, path, body=None, *, headers=None, content=None):
    h = dict(server.headers if headers is None else headers)
    return httpx.post(f"{server.url}{path}", json=body, content=content, headers=h, timeout=30)


def error_of(resp, status):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_unknown_model_lists_loaded_ones(server):
    err = error_of(post(server, "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}), 404)
    assert "'nope' is not loaded" in err["message"] and "toy-chat" in err["message"] and err["param"] == "model"


def test_wrong_field_type_names_the_field(server):
    err = error_of(post(server, "/v1/chat/completions", {"model": "toy-chat", "messages": "hi"}), 400)
    assert err["param"].startswith("messages")
    err = error_of(post(server, "/v1/chat/completions",
                        {"model": "toy-chat", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}), 400)
    assert err["param"] == "temperature"
    err = error_of(post(server, "/v1/audio/speech", {"model": "toy-tts", "voice": "alpha"}), 400)
    assert "'input' is required" in err["message"]


def test_unsupported_voice_format_and_route(server):
    err = error_of(post(server, "/v1/audio/speech", {"model": "toy-tts", "input": "x", "voice": "tara"}), 400)
    assert "alpha, beta" in err["message"] and err["param"] == "voice"
    err = error_of(post(server, "/v1/audio/speech",
                        {"model": "toy-tts", "input": "x", "voice": "alpha", "response_format": "wma"}), 400)
    assert err["param"] == "response_format" and "wav" in err["message"] and "mp3" in err["message"]
    err = error_of(post(server, "/v1/audio/speech",
                        {"model": "toy-tts", "input": "x", "voice": "alpha", "speed": 1.5}), 400)
    assert err["param"] == "speed"
    err = error_of(post(server, "/v1/images/generations", {"model": "toy-chat", "prompt": "a cat"}), 404)
    assert "does not serve the images route" in err["message"] and "toy-image" in err["message"]
    err = error_of(post(server, "/v1/images/edits", {"model": "toy-tts", "prompt": "x", "image": "aGk="}), 404)
    err = error_of(post(server, "/v1/images/generations", {"model": "toy-image", "prompt": "x", "size": "512x512"}), 400)
    assert "64x64" in err["message"]


def test_malformed_json_and_oversized_body(server):
    err = error_of(post(server, "/v1/chat/completions", content=b"{not json",
                        headers={**server.headers, "content-type": "application/json"}), 400)
    assert "JSON" in err["message"]
    big = {"model": "toy-chat", "messages": [{"role": "user", "content": "x" * (17 * 1024 * 1024)}]}
    err = error_of(post(server, "/v1/chat/completions", big), 413)
    assert "limit" in err["message"]


def test_api_key_required_everywhere_but_health(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/openapi.json"),
                         ("POST", "/v1/audio/speech"), ("POST", "/v1/chat/completions"), ("POST", "/v1/walks/toy-tts"),
                         ("POST", "/v1/images/generations"), ("GET", "/no/such/route")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            resp = httpx.request(method, f"{server.url}{path}", headers=headers, json={})
            error_of(resp, 401)


def test_native_bad_tensor_is_a_400(server):
    bad = {"inputs": {"x": {"dtype": "float32", "shape": [4], "data": "AAAA"}}}
    err = error_of(post(server, "/v1/walks/fixture-echo", bad), 400)
    assert "needs 16" in err["message"]
    err = error_of(post(server, "/v1/walks/toy-tts", {"inputs": {"text": 3, "voice": "alpha"}}), 400)
    assert "'text'" in err["message"]


@pytest.fixture(scope="module")
def tiny_server():
    srv = Server(["toy-tts"], "--max-running", "1", "--max-queued", "0", api_key=None, MSTAR_TOY_STEP_DELAY="0.02")
    yield srv
    srv.stop()


async def test_queue_full_is_503_with_retry_after(tiny_server):
    body = {"model": "toy-tts", "input": "a long enough sentence to keep the only slot busy", "voice": "alpha"}
    async with httpx.AsyncClient(base_url=tiny_server.url, timeout=30) as client:
        async with client.stream("POST", "/v1/audio/speech", json=body) as first:
            assert first.status_code == 200
            await first.aiter_bytes().__anext__()
            second = await client.post("/v1/audio/speech", json=body)
            assert second.status_code == 503 and second.headers["retry-after"]
            assert "capacity" in second.json()["error"]["message"]
        await asyncio.sleep(0.3)  # the disconnect cancelled the first; the slot is free again
        again = await client.post("/v1/audio/speech", json=dict(body, input="ok"))
        assert again.status_code == 200
