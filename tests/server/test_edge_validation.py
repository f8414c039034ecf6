"""Every request parameter is checked at the HTTP edge: a bad one is a 400 naming the field, on every route and
on the native endpoint alike, never a 500, a hang or a frozen node (issue 10). Also HEAD /health, and a pcm/wav
stream that fails mid-way ends so that the client can tell."""

from __future__ import annotations

import base64
import json

import httpx
import pytest

TIMEOUT = 30  # a rejected request answers at once; the old failure mode was a request that never answered

SPEECH = {"model": "orpheus", "input": "Hi there", "voice": "tara", "response_format": "pcm", "max_tokens": 4}
CHAT = {"model": "llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def post(server, path, body):
    # json.dumps writes Infinity/NaN for non-finite floats, as a sloppy JavaScript or Python client would
    return httpx.post(f"{server.url}{path}", content=json.dumps(body), timeout=TIMEOUT,
                      headers={**server.headers, "content-type": "application/json"})


def rejects(resp, field: str) -> str:
    """Assert a 400 in OpenAI's shape whose message and `param` name `field`; return the message."""
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] is not None and err["param"].split(".")[-1] == field, err
    assert field in err["message"], err
    return err["message"]


BAD_SEEDS = [1.5, 2**64, 2**63, -1, "abc", float("inf"), float("nan"), True, [1], {"a": 1}]
SEED_ROUTES = [
    ("/v1/audio/speech", SPEECH),
    ("/v1/audio/speech", {"model": "toy-tts", "input": "hey", "voice": "alpha"}),
    ("/v1/chat/completions", CHAT),
    ("/v1/chat/completions", {**CHAT, "model": "toy-chat"}),
    ("/v1/images/generations", {"model": "toy-image", "prompt": "a cat", "size": "8x8"}),
    ("/v1/walks/llama", {"inputs": {"prompt": "Hi", "max_tokens": 2}}),
    ("/v1/walks/orpheus", {"inputs": {"text": "Hi", "voice": "tara", "max_tokens": 4}}),
    ("/v1/walks/toy-chat", {"inputs": {"messages": [{"role": "user", "content": "x"}]}}),
]


def with_field(body: dict, field: str, value) -> dict:
    if "inputs" in body:
        return {**body, "inputs": {**body["inputs"], field: value}}
    return {**body, field: value}


@pytest.mark.parametrize(("path", "body"), SEED_ROUTES, ids=[f"{p}:{b.get('model', '')}" for p, b in SEED_ROUTES])
def test_bad_seed_is_a_400_naming_seed_everywhere(edge_server, path, body):
    for seed in BAD_SEEDS:
        message = rejects(post(edge_server, path, with_field(body, "seed", seed)), "seed")
        # says what to send (routes that declare `seed` in their schema answer in pydantic's words)
        assert "2**63 - 1" in message or "valid integer" in message or "less than or equal" in message \
            or "greater than or equal" in message, message


def test_good_seeds_at_the_bounds_are_served(edge_server):
    for seed in (0, 2**63 - 1):
        assert post(edge_server, "/v1/walks/llama", {"inputs": {"prompt": "Hi", "max_tokens": 2, "seed": seed,
                                                                "temperature": 1.0}, "stream": False}).status_code == 200
    # n images get seeds seed, seed+1, ...: at the top of the range they wrap instead of overflowing
    resp = post(edge_server, "/v1/images/generations",
                {"model": "toy-image", "prompt": "a cat", "size": "4x4", "n": 2, "seed": 2**63 - 1})
    assert resp.status_code == 200 and len(resp.json()["data"]) == 2


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, 1e-6, -0.5, float("inf"), float("nan")])
def test_temperature_is_zero_or_above_the_floor(edge_server, temperature):
    for path, body in [("/v1/chat/completions", CHAT), ("/v1/audio/speech", SPEECH),
                       ("/v1/walks/llama", {"inputs": {"prompt": "Hi", "max_tokens": 2}})]:
        rejects(post(edge_server, path, with_field(body, "temperature", temperature)), "temperature")
    resp = post(edge_server, "/v1/chat/completions", {**CHAT, "temperature": 1e-5, "top_p": 0.5})
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("penalty", [1e-320, 0.0, 1e300, float("inf")])
def test_repetition_penalty_stays_where_the_arithmetic_is_finite(edge_server, penalty):
    """1e-320 rounds to 0 in float32: logits divided by it became NaN and failed the whole batch (issue 10)."""
    rejects(post(edge_server, "/v1/audio/speech", {**SPEECH, "repetition_penalty": penalty}), "repetition_penalty")
    rejects(post(edge_server, "/v1/walks/llama", {"inputs": {"prompt": "Hi", "repetition_penalty": penalty}}),
            "repetition_penalty")


def test_vocabulary_bounds_logprobs_and_top_k(edge_server):
    native = {"inputs": {"prompt": "Hi", "max_tokens": 2}, "stream": False}
    assert "vocabulary" in rejects(post(edge_server, "/v1/walks/llama", with_field(native, "logprobs", 10**9)), "logprobs")
    assert "vocabulary" in rejects(post(edge_server, "/v1/walks/llama", with_field(native, "top_k", 10**6)), "top_k")
    assert "vocabulary" in rejects(post(edge_server, "/v1/walks/orpheus", {"inputs": {"text": "Hi", "top_k": 10**7}}),
                                   "top_k")
    rejects(post(edge_server, "/v1/chat/completions", {**CHAT, "top_k": 10**6}), "top_k")
    rejects(post(edge_server, "/v1/chat/completions", {**CHAT, "top_logprobs": 10**9}), "top_logprobs")
    rejects(post(edge_server, "/v1/walks/llama", with_field(native, "logprobs", 2**70)), "logprobs")
    ok = post(edge_server, "/v1/walks/llama", with_field(native, "logprobs", 3))
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("value", [1.5, True, "8", 2.0, 0, -3, 2**70, float("inf")])
def test_lengths_are_integers(edge_server, value):
    rejects(post(edge_server, "/v1/walks/llama", {"inputs": {"prompt": "Hi", "max_tokens": value}}), "max_tokens")
    rejects(post(edge_server, "/v1/walks/orpheus", {"inputs": {"text": "Hi", "max_tokens": value}}), "max_tokens")
    rejects(post(edge_server, "/v1/walks/toy-chat", {"inputs": {"messages": [{"role": "user", "content": "x"}],
                                                                "max_tokens": value}}), "max_tokens")
    rejects(post(edge_server, "/v1/audio/speech", {**SPEECH, "max_tokens": value}), "max_tokens")
    rejects(post(edge_server, "/v1/chat/completions", {**CHAT, "max_tokens": value}), "max_tokens")


def test_tensor_shapes_are_bounded(edge_server):
    def tensor(shape, data=""):
        return {"inputs": {"x": {"dtype": "float32", "shape": shape, "data": data}}, "stream": False}

    for shape in ([0, 2**70], [0, 2**40, 2**40], [2**62, 2**62], [-1, 0], [1.5], [True], "[1]", [1] * 9):
        resp = post(edge_server, "/v1/walks/fixture-echo", tensor(shape))
        assert resp.status_code == 400, (shape, resp.text)
        assert resp.json()["error"]["param"] == "inputs.x.shape", resp.text
    empty = post(edge_server, "/v1/walks/fixture-echo", tensor([0, 3]))
    assert empty.status_code == 200 and empty.json()["outputs"]["y"]["shape"] == [0, 3]
    data = base64.b64encode(b"\0" * 8).decode()
    assert post(edge_server, "/v1/walks/fixture-echo", tensor([2, 1], data)).status_code == 200


def test_outputs_beyond_64_bit_ints_still_encode(edge_server):
    """The echo model returns what it got; orjson cannot write 2**64, which ended the stream with a 500 event."""
    resp = post(edge_server, "/v1/walks/fixture-echo", {"inputs": {"x": 2**64}, "stream": False})
    assert resp.status_code == 200 and resp.json()["outputs"]["y"] == str(2**64)
    with httpx.stream("POST", f"{edge_server.url}/v1/walks/fixture-echo", json={"inputs": {"x": -(2**70)}},
                      headers=edge_server.headers, timeout=TIMEOUT) as r:
        events = [json.loads(line) for line in r.iter_lines()]
    assert [e["event"] for e in events] == ["output", "done"] and events[0]["value"] == str(-(2**70))


def test_lone_surrogates_in_echoed_text_do_not_break_the_answer(edge_server):
    """JSON may carry "\\ud800"; orjson cannot write it back, which made echoes and error messages 500s."""
    resp = post(edge_server, "/v1/walks/fixture-echo", {"inputs": {"x": "a\ud800"}, "stream": False})
    assert resp.status_code == 200 and resp.json()["outputs"]["y"] == "a?"
    bad_tensor = {"dtype": "complex7", "shape": [1], "data": ""}
    err = post(edge_server, "/v1/walks/fixture-echo", {"inputs": {"\ud800": bad_tensor}}).json()["error"]
    assert "inputs.?.dtype" in err["message"]


def test_sampling_params_refuse_what_the_engine_cannot_run():
    """The same checks without a server: every model that builds SamplingParams gets them."""
    from mstar_core.errors import RequestError
    from mstar_core.sampling import SamplingParams

    for field, value in [("seed", 1.5), ("seed", 2**63), ("seed", -1), ("seed", True), ("max_tokens", 1.5),
                         ("max_tokens", True), ("temperature", 1e-320), ("temperature", float("nan")),
                         ("top_p", float("nan")), ("top_k", 2.0), ("logprobs", "3"), ("stop_token_ids", [1.5]),
                         ("stop_token_ids", "ab"), ("stop_sequences", [[1], 2]), ("repetition_penalty", 0.0)]:
        with pytest.raises(RequestError) as info:
            SamplingParams.from_mapping({field: value})
        assert info.value.param == field and f"'{field}'" in str(info.value), (field, value, str(info.value))
    params = SamplingParams(temperature=1, seed=2**63 - 1, top_k=50, logprobs=5, stop_token_ids=[3])
    assert params.temperature == 1.0 and isinstance(params.temperature, float)
    assert params.check_vocab(50) is params
    for vocab, alone in [(49, SamplingParams(top_k=50)), (4, SamplingParams(logprobs=5))]:
        field = "top_k" if alone.top_k else "logprobs"
        with pytest.raises(RequestError, match=f"'{field}' must be at most the vocabulary size {vocab}"):
            alone.check_vocab(vocab)
    with pytest.raises(RequestError, match="'stop_token_ids' has ids \\[3\\] outside the vocabulary"):
        SamplingParams(stop_token_ids=[3]).check_vocab(3)


def test_poisoned_requests_leave_the_node_serving(edge_server):
    """The old failure: a bad seed reached `manual_seed` inside the engine and froze every stream on the node."""
    for seed in (1.5, 2**64, "abc", float("inf")):
        rejects(post(edge_server, "/v1/audio/speech", {**SPEECH, "seed": seed}), "seed")
        rejects(post(edge_server, "/v1/walks/llama", {"inputs": {"prompt": "Hi", "seed": seed}}), "seed")
    resp = post(edge_server, "/v1/chat/completions", {**CHAT, "temperature": 0.8, "seed": 5})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1
    with httpx.stream("POST", f"{edge_server.url}/v1/audio/speech", json={**SPEECH, "seed": 3},
                      headers=edge_server.headers, timeout=120) as r:
        assert r.status_code == 200
        r.read()  # the whole (possibly empty) pcm body arrives and ends cleanly


def test_head_health(edge_server):
    resp = httpx.head(f"{edge_server.url}/health", timeout=TIMEOUT)  # no API key: probes don't carry one
    assert resp.status_code == 200 and resp.content == b""
    assert resp.headers["content-type"] == "application/json"
    assert httpx.get(f"{edge_server.url}/health", timeout=TIMEOUT).json()["status"] == "ok"


@pytest.mark.parametrize("fmt", ["pcm", "wav"])
def test_audio_stream_failing_midway_is_cut_detectably(edge_server, fmt):
    body = {"model": "toy-tts", "input": "fail: after the first chunk", "voice": "alpha", "response_format": fmt}
    received = b""
    with pytest.raises(httpx.RemoteProtocolError, match="incomplete"):
        with httpx.stream("POST", f"{edge_server.url}/v1/audio/speech", json=body, headers=edge_server.headers,
                          timeout=TIMEOUT) as r:
            assert r.status_code == 200  # the status line went out with the first chunk
            for data in r.iter_bytes():
                received += data
    header = 44 if fmt == "wav" else 0
    assert len(received) == header + 2 * 480, "the first chunk arrives whole, then the body is cut"
    log = edge_server.serving_output()
    assert "stream cut mid-body" in log and "told to fail at chunk 1" in log
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
    # a healthy stream on the same connection pool still ends cleanly
    ok = httpx.post(f"{edge_server.url}/v1/audio/speech", json={**body, "input": "fine"}, headers=edge_server.headers,
                    timeout=TIMEOUT)
    assert ok.status_code == 200 and len(ok.content) == header + 4 * 2 * 480


def test_sse_stream_failing_midway_ends_with_an_error_event(edge_server):
    body = {"model": "toy-tts", "input": "fail: now", "voice": "alpha", "response_format": "pcm", "stream_format": "sse"}
    with httpx.stream("POST", f"{edge_server.url}/v1/audio/speech", json=body, headers=edge_server.headers,
                      timeout=TIMEOUT) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[0]["type"] == "speech.audio.delta" and events[-1]["type"] == "error"
    assert "told to fail" in events[-1]["error"]["message"]
