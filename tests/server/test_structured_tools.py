"""Structured outputs, tool calls and the Responses API over the tiny `llama` preset, driven by the openai client.

The weights are random, so only what the grammar enforces is asserted: schema-valid JSON, well-formed calls of
the named tools with valid arguments, the route's shapes and event sequences, and the 400s / 404s.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai import OpenAI

from tests.server.helpers import Server, metric

pytest.importorskip("mstar_llm")
pytest.importorskip("mstar_kvcache")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"], "additionalProperties": False}
PARAMS = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"enum": [1, 2, 3]}},
          "required": ["unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
FLAT = [{"type": "function", **t["function"]} for t in TOOLS]
ASK = [{"role": "user", "content": "Weather?"}]


@pytest.fixture(scope="module")
def llama():
    srv = Server(["llama"])
    yield srv
    srv.stop()
    assert "Traceback" not in srv.serving_output(), srv.serving_output()[-3000:]


@pytest.fixture(scope="module")
def client(llama):
    return OpenAI(base_url=f"{llama.url}/v1", api_key=llama.api_key, max_retries=0, timeout=120)


def _fmt(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_json_schema_on_chat_and_completions(client):
    chat = client.chat.completions.create(model="llama", messages=ASK, max_tokens=40, temperature=0.7, seed=1,
                                          response_format=_fmt())
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    comp = client.completions.create(model="llama", prompt="Hello", max_tokens=40, extra_body={"response_format": _fmt()})
    jsonschema.validate(json.loads(comp.choices[0].text), SCHEMA)
    streamed = client.chat.completions.create(model="llama", messages=ASK, max_tokens=40, temperature=0.7, seed=1,
                                              response_format=_fmt(), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat.choices[0].message.content


def test_bad_schemas_and_unsupported_combinations_are_400s(client):
    bad = {"type": "object", "properties": {"age": {"type": "integr"}}}
    with pytest.raises(openai.BadRequestError, match=r"response_format\.json_schema\.schema\.properties\.age"):
        client.chat.completions.create(model="llama", messages=ASK, response_format=_fmt(bad))
    with pytest.raises(openai.BadRequestError, match=r"uses uniqueItems"):
        client.chat.completions.create(model="llama", messages=ASK,
                                       response_format=_fmt({"type": "array", "uniqueItems": True}))
    with pytest.raises(openai.BadRequestError, match=r"cannot be combined with tools"):
        client.chat.completions.create(model="llama", messages=ASK, tools=TOOLS, response_format=_fmt())
    with pytest.raises(openai.BadRequestError, match=r"tool_choice.*'nope'.*not among the tools"):
        client.chat.completions.create(model="llama", messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\]\.function\.parameters\.properties\.x"):
        client.chat.completions.create(model="llama", messages=ASK, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": 3}}}}}])


def _call_ok(name, arguments):
    assert name in ("get_weather", "get_time")
    args = json.loads(arguments)
    if name == "get_weather":
        jsonschema.validate(args, PARAMS)


def test_required_and_named_tool_calls_round_trip(client):
    whole = client.chat.completions.create(model="llama", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    _call_ok(call.function.name, call.function.arguments)
    # streamed: the same call as deltas (name first, then argument pieces)
    chunks = list(client.chat.completions.create(model="llama", messages=ASK, tools=TOOLS, tool_choice="required",
                                                 parallel_tool_calls=False, max_tokens=200, temperature=0, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == call.function.name and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    named = client.chat.completions.create(model="llama", messages=ASK, tools=TOOLS, max_tokens=200, temperature=0.9,
                                           seed=3, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = named.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"]
    _call_ok("get_weather", calls[0].function.arguments)
    # the result goes back through the chat template as a tool message
    back = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'}]
    reply = client.chat.completions.create(model="llama", messages=back, tools=TOOLS, tool_choice="none", max_tokens=8)
    plain = client.chat.completions.create(model="llama", messages=ASK, max_tokens=1)
    assert reply.choices[0].message.tool_calls is None
    # the call and its result are in the prompt (the tiny tokenizer spends about a token per character)
    assert reply.usage.prompt_tokens > plain.usage.prompt_tokens + len(call.function.arguments) + 18


def test_responses_tool_round_trip_stream_and_store(client, llama):
    first = client.responses.create(model="llama", input="Weather?", instructions="Use tools.", tools=FLAT,
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=200,
                                    temperature=0)
    assert first.status == "completed"
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1
    _call_ok(calls[0].name, calls[0].arguments)
    assert client.responses.retrieve(first.id).id == first.id
    events = list(client.responses.create(model="llama", input=[{"type": "function_call_output",
                                                                  "call_id": calls[0].call_id, "output": "18 C"}],
                                          previous_response_id=first.id, tools=FLAT, max_output_tokens=12,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    if any(o.type == "message" for o in final.output):
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert "response.output_item.added" in kinds and "response.content_part.added" in kinds
        assert [e.text for e in events if e.type == "response.output_text.done"] == [text]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(model="llama", input="hi", previous_response_id="resp_missing")
    unstored = client.responses.create(model="llama", input="hi", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_responses_text_format_and_cached_prefix(client, llama):
    def forwarded() -> float:
        return metric(llama, "mstar_node_stat", model="llama", node="lm", stat="tokens_forwarded")

    before = forwarded()
    first = client.responses.create(model="llama", input="Answer in JSON.", max_output_tokens=40, temperature=0,
                                    text={"format": {"type": "json_schema", "name": "a", "schema": SCHEMA,
                                                     "strict": True}})
    jsonschema.validate(json.loads(first.output_text), SCHEMA)
    middle = forwarded()
    second = client.responses.create(model="llama", input="And again.", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    after = forwarded()
    assert middle - before >= first.usage.input_tokens  # the first prompt was computed
    # the continuation's prompt starts with the first prompt and reply: only what follows their cached pages runs
    new_rows = (after - middle) - second.usage.output_tokens
    assert new_rows < second.usage.input_tokens - first.usage.input_tokens + 16 + first.usage.output_tokens
    assert new_rows <= second.usage.input_tokens - (first.usage.input_tokens // 16) * 16  # the first prompt's pages


def test_responses_bad_input_is_a_400(llama):
    r = httpx.post(f"{llama.url}/v1/responses", headers=llama.headers, timeout=30,
                   json={"model": "llama", "input": [{"type": "reasoning"}]})
    assert r.status_code == 400 and "input[0].type" in r.json()["error"]["message"]
    r = httpx.post(f"{llama.url}/v1/responses", headers=llama.headers, timeout=30,
                   json={"model": "llama", "input": "hi", "background": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "background"
