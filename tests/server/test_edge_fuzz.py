"""Fuzz the HTTP edge: hypothesis over every request field of every route and of the native endpoint (non-finite
floats, huge ints, wrong types, nested junk, unknown fields) against a real server; no answer may be a 5xx and
none may hang. Streams are read for a moment and checked for a server-side error event too.

Valid lengths are drawn small (at most 64) so that a request the server accepts stays cheap: the point is the
edge's answer, not generation. Examples are derandomized, so a run is reproducible.
"""

from __future__ import annotations

import base64
import json
import os
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REQUEST_TIMEOUT = 30  # far above any answer here: hitting it means the server hung on the request
READ_BUDGET_S = 0.25  # how long a streamed body is read before the client hangs up (errors come early)
EXAMPLES = int(os.environ.get("MSTAR_EDGE_FUZZ_EXAMPLES", "50"))  # per route; raise it for a deeper run

# -- values ---------------------------------------------------------------------------------------------------

EDGE_NUMBERS = [0, 1, -1, 2, 7, 64, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**70, -(2**70), 10**30,
                0.0, -0.0, 0.5, 1.5, 2.0, 1e-5, 1e-6, 1e-320, 5e-324, 1e308, -1e308,
                float("inf"), float("-inf"), float("nan"), True, False]
LONE_SURROGATE = "\ud800"  # valid in a JSON string escape, not writable as UTF-8
WRONG_TYPES = ["", "abc", "1", LONE_SURROGATE, None, [], [1], {}, {"a": 1}, [[0.5]]]
#: What the sweep sends to every field of every route, one field at a time.
SWEEP = [1.5, 2**64, 2**63, -1, 0, 1e-320, float("inf"), float("nan"), True, "abc", LONE_SURROGATE, None, [1],
         {"a": 1}]
edge_numbers = st.sampled_from(EDGE_NUMBERS)
scalars = st.one_of(  # the edge values twice: they are where validation goes wrong
    edge_numbers, edge_numbers, st.integers(min_value=-10, max_value=64),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12), st.none(),
)
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
token_ids = st.lists(st.one_of(st.integers(min_value=0, max_value=300), st.sampled_from(EDGE_NUMBERS)), max_size=4)
messages = st.one_of(
    junk,
    st.lists(st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["system", "developer", "user", "assistant", "tool"]), junk)},
        optional={"content": st.one_of(st.text(max_size=20), junk,
                                       st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                                       "text": st.one_of(st.text(max_size=8), junk)})))},
    ), min_size=0, max_size=3),
)


def tensor_json(dtypes=("float32", "int64", "uint8", "bool", "bfloat16")):
    shape = st.one_of(st.lists(st.one_of(st.integers(min_value=0, max_value=4), st.sampled_from(EDGE_NUMBERS)),
                               max_size=9), junk)
    data = st.one_of(st.binary(max_size=64).map(lambda b: base64.b64encode(b).decode()), junk)
    return st.fixed_dictionaries({"dtype": st.one_of(st.sampled_from(dtypes), junk), "shape": shape, "data": data})


def field(*valid):
    """A field's value: an edge number, a wrong type, nested junk, or a valid one (so later checks are reached)."""
    return st.one_of(edge_numbers, st.sampled_from(WRONG_TYPES), junk,
                     *(st.just(v) if not isinstance(v, st.SearchStrategy) else v for v in valid))


SAMPLING = {
    "seed": field(0, 5), "temperature": field(0.0, 0.7), "top_p": field(0.9), "top_k": field(0, 5),
    "min_p": field(0.1), "repetition_penalty": field(1.2), "logprobs": field(0, 2),
    "presence_penalty": field(0.5, -2.0), "frequency_penalty": field(0.5, 2.0),
    "logit_bias": field({"5": 1.0}, {"5": -100, "7": 100}, {"99999999": 1}, {"x": 1}),
    # never null: null means the model's default length (hundreds of tokens), which only costs time here
    "max_tokens": st.one_of(junk.filter(lambda v: v is not None), st.sampled_from([1, 4])),
}
#: Fields a mutation never removes, for the same reason.
KEPT = {"max_tokens"}

# -- routes: (path, a valid body, per-field strategies) -----------------------------------------------------

ROUTES = {
    "speech-orpheus": ("/v1/audio/speech",
                       {"model": "orpheus", "input": "Hi", "voice": "tara", "response_format": "pcm", "max_tokens": 4},
                       {"input": field(st.text(max_size=20)), "voice": field("tara", "zoe"),
                        "response_format": field("wav", "pcm", "flac"), "stream_format": field("audio", "sse"),
                        "speed": field(1.0, 2.0), "stream": field(True, False), "instructions": field("calm"),
                        **SAMPLING}),
    "speech-toy": ("/v1/audio/speech", {"model": "toy-tts", "input": "hey", "voice": "alpha"},
                   {"input": field(st.text(max_size=8)), "voice": field("alpha", "beta"),
                    "response_format": field("wav", "pcm", "flac"), "stream_format": field("audio", "sse"),
                    "model": field("toy-tts", "orpheus", "llama"), "seed": SAMPLING["seed"]}),
    "chat-llama": ("/v1/chat/completions",
                   {"model": "llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
                   {"messages": messages, "stream": field(True, False), "stream_options": field({"include_usage": True}),
                    "max_completion_tokens": field(2), "stop": field("a", ["x", "y"]),
                    "modalities": field(["text"]), "top_logprobs": field(2, 20, 21), **SAMPLING,
                    "logprobs": field(True, False), "n": field(1, 2), "ignore_eos": field(True, False),
                    "response_format": field({"type": "text"}, {"type": "json_object"}), "user": field("u")}),
    "completions-llama": ("/v1/completions", {"model": "llama", "prompt": "Hi", "max_tokens": 3},
                          {"prompt": field("Hi", st.text(max_size=10), [1, 2, 3], ["a", "b"], [[1, 2], [3]],
                                           token_ids, st.lists(token_ids, max_size=3)),
                           "stream": field(True, False), "stream_options": field({"include_usage": True}),
                           "stop": field("a", ["x", "y"]), "n": field(1, 2), "echo": field(False, True),
                           "suffix": field("", "x"), "best_of": field(1, 2), **SAMPLING, "logprobs": field(0, 2, 21),
                           "ignore_eos": field(True, False)}),
    "chat-toy": ("/v1/chat/completions",
                 {"model": "toy-chat", "messages": [{"role": "user", "content": "Hi"}], "stream": True},
                 {"messages": messages, "max_tokens": SAMPLING["max_tokens"], "seed": SAMPLING["seed"],
                  "temperature": SAMPLING["temperature"], "stop": field("i"), "model": field("toy-chat", "nope")}),
    "images": ("/v1/images/generations", {"model": "toy-image", "prompt": "a cat", "size": "4x4"},
               {"prompt": field(st.text(max_size=10)), "n": field(1, 3), "size": field("8x8", "99999x1", "0x4"),
                "seed": field(0, 2**63 - 1), "response_format": field("b64_json"), "steps": junk}),
    "images-edit": ("/v1/images/edits", {"model": "toy-image", "prompt": "a cat", "size": "4x4", "image": "aGk="},
                    {"image": field("aGk=", "***"), "seed": SAMPLING["seed"], "n": field(2)}),
}

NATIVE = {
    "walks-llama": ("llama", {"prompt": field("Hi", st.text(max_size=10)), "input_ids": field(token_ids),
                              "messages": messages, "stop_token_ids": field(token_ids),
                              "stop_sequences": field(st.lists(token_ids, max_size=2)),
                              "ignore_eos": field(True), **SAMPLING}, {"prompt": "Hi", "max_tokens": 2}),
    "walks-orpheus": ("orpheus", {"text": field("Hi"), "voice": field("tara"), **SAMPLING},
                      {"text": "Hi", "voice": "tara", "max_tokens": 4}),
    "walks-echo": ("fixture-echo", {"x": st.one_of(tensor_json(), junk)},
                   {"x": {"dtype": "float32", "shape": [1], "data": base64.b64encode(b"\0" * 4).decode()}}),
    "walks-toy-chat": ("toy-chat", {"messages": messages, "max_tokens": SAMPLING["max_tokens"]},
                       {"messages": [{"role": "user", "content": "x"}]}),
    "walks-toy-tts": ("toy-tts", {"text": field("hey"), "voice": field("alpha")}, {"text": "hey", "voice": "alpha"}),
}
WALK_FIELDS = {"stream": field(True, False), "timeout": field(0.5, 60.0), "outputs": field(["y"], ["nope"])}


@st.composite
def mutated(draw, base: dict, fields: dict):
    """`base` with one to three fields replaced (the rest stay valid, so checks deep in a model's `prepare` are
    reached), sometimes one removed, sometimes an unknown one added."""
    body = dict(base)
    for name in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=3, unique=True)):
        body[name] = draw(fields[name])
    if draw(st.integers(0, 4)) == 0:
        name = draw(st.sampled_from(sorted(base)))
        if name not in KEPT:
            body.pop(name, None)
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.one_of(st.text(min_size=1, max_size=8), st.just(LONE_SURROGATE)))] = draw(junk)
    return body


@st.composite
def native_body(draw, fields: dict, base_inputs: dict):
    body = {"inputs": draw(mutated(base_inputs, fields))}
    if draw(st.integers(0, 3)) == 0:  # now and then the request's own fields too (stream, timeout, outputs)
        body = draw(mutated(body, WALK_FIELDS))
    return body


# -- the client's side ----------------------------------------------------------------------------------------


def server_error_in_stream(resp: httpx.Response) -> str | None:
    """Read a streamed body for up to READ_BUDGET_S; return a server-side (5xx) error event if one arrives."""
    deadline = time.monotonic() + READ_BUDGET_S
    kind = resp.headers.get("content-type", "")
    if "event-stream" not in kind and "ndjson" not in kind:
        return None  # raw audio has no room for an error event (its cut is tested in test_edge_validation)
    for line in resp.iter_lines():
        payload = line[6:] if line.startswith("data: ") else line
        if payload.startswith("{"):
            err = json.loads(payload).get("error")
            status = json.loads(payload).get("status") if err is None else None
            if isinstance(err, dict) and err.get("type") == "server_error":
                return payload
            if status is not None and int(status) >= 500:
                return payload
        if time.monotonic() > deadline:
            break
    return None


def check(client: httpx.Client, path: str, body) -> None:
    started = time.monotonic()
    try:
        # json.dumps writes Infinity and NaN, which the server's JSON parser takes: the edge must handle them
        with client.stream("POST", path, content=json.dumps(body), timeout=REQUEST_TIMEOUT) as resp:
            status = resp.status_code
            if status == 200:
                error = server_error_in_stream(resp)
                assert error is None, f"{path} {body!r}: 200 then a server error in the stream: {error}"
                return
            text = resp.read().decode(errors="replace")
    except httpx.TimeoutException:
        pytest.fail(f"{path} hung (no answer within {REQUEST_TIMEOUT}s) for body {body!r}")
    # a deadline the client set itself may expire: that 504 is the answer it asked for
    asked_timeout = isinstance(body, dict) and body.get("timeout") is not None
    assert status < 500 or (status == 504 and asked_timeout), f"{path} answered {status} for {body!r}: {text[:500]}"
    assert time.monotonic() - started < REQUEST_TIMEOUT


@pytest.fixture(scope="module")
def client(edge_server):
    with httpx.Client(base_url=edge_server.url, headers={**edge_server.headers, "content-type": "application/json"}) as c:
        yield c
    # after all the junk, a plain request is still served and nothing was logged as a traceback
    ok = httpx.post(f"{edge_server.url}/v1/chat/completions", headers=edge_server.headers, timeout=REQUEST_TIMEOUT,
                    json={"model": "llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert "Traceback" not in edge_server.serving_output(), edge_server.serving_output()[-4000:]


FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_openai_routes_never_5xx_or_hang(client, route):
    path, base, fields = ROUTES[route]

    @FUZZ
    @given(body=st.one_of(mutated(base, fields), mutated(base, fields), mutated(base, fields), junk))
    def run(body):
        check(client, path, body)

    run()


@pytest.mark.parametrize("route", sorted(NATIVE))
def test_native_endpoint_never_5xx_or_hang(client, route):
    model, fields, base_inputs = NATIVE[route]

    @FUZZ
    @given(body=st.one_of(native_body(fields, base_inputs), native_body(fields, base_inputs), junk))
    def run(body):
        check(client, f"/v1/walks/{model}", body)

    run()


@pytest.mark.parametrize("route", sorted(ROUTES) + sorted(NATIVE))
def test_every_field_takes_every_edge_value(client, route):
    """Deterministic complement to the fuzz: each field alone set to each SWEEP value, the others valid."""
    if route in ROUTES:
        path, base, fields = ROUTES[route]
        bodies = [{**base, name: value} for name in sorted(fields) for value in SWEEP]
    else:
        model, fields, base_inputs = NATIVE[route]
        path = f"/v1/walks/{model}"
        bodies = [{"inputs": {**base_inputs, name: value}} for name in sorted(fields) for value in SWEEP]
        bodies += [{"inputs": base_inputs, name: value} for name in sorted(WALK_FIELDS) for value in SWEEP]
    for body in bodies:
        if body.get("max_tokens", 1) is None or body.get("inputs", {}).get("max_tokens", 1) is None:
            continue  # null is the model's default length: valid, and only slow
        check(client, path, body)
