"""Structured outputs and tool calls on BAGEL's chat (understanding) through the official openai client, tiny preset.

The weights are random, so only what the grammar enforces is asserted: schema-valid JSON, well-formed calls of the
named tools with valid arguments (hermes `<tool_call>` format, BAGEL's LLM being Qwen2), the route's shapes.
"""

from __future__ import annotations

import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
Image = pytest.importorskip("PIL.Image")

# `client`: the session's tiny BAGEL server (tests/bagel/conftest.py)

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"], "additionalProperties": False}
PARAMS = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"enum": [1, 2, 3]}},
          "required": ["unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def _png() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 30, 10)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


#: An image and a question: the reply's prompt is several writes (text block, ViT block, text block).
ASK = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": _png()}},
                                    {"type": "text", "text": "What colour is it? Answer in JSON."}]}]


def _fmt(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_json_schema_and_json_object(client):
    chat = client.chat.completions.create(model="bagel", messages=ASK, max_tokens=60, temperature=0.7, seed=1,
                                          response_format=_fmt())
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    streamed = client.chat.completions.create(model="bagel", messages=ASK, max_tokens=60, temperature=0.7, seed=1,
                                              response_format=_fmt(), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat.choices[0].message.content
    obj = client.chat.completions.create(model="bagel", messages=ASK, max_tokens=40, temperature=0.7, seed=0,
                                         response_format={"type": "json_object"})
    choice = obj.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # random weights may not close an open object within max_tokens: it ends with length
        assert choice.finish_reason == "length" and choice.message.content.lstrip().startswith("{")
        assert obj.usage.completion_tokens == 40  # every reply token counted, none of the prompt writes'
    # the Responses API's text.format reaches the same grammar
    resp = client.responses.create(model="bagel", input="Answer in JSON.", max_output_tokens=60, temperature=0.7,
                                   text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA,
                                                    "strict": True}})
    jsonschema.validate(json.loads(resp.output_text), SCHEMA)


def _call_ok(name, arguments):
    assert name in ("get_weather", "get_time")
    args = json.loads(arguments)
    if name == "get_weather":
        jsonschema.validate(args, PARAMS)


def test_required_and_named_tool_calls(client):
    whole = client.chat.completions.create(model="bagel", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    _call_ok(call.function.name, call.function.arguments)
    # a named function, streamed: the call as deltas (name first, then argument pieces)
    chunks = list(client.chat.completions.create(model="bagel", messages=ASK, tools=TOOLS, max_tokens=200, temperature=0.9,
                                                 seed=3, stream=True,
                                                 tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas if d.function.name] == ["get_weather"] and deltas[0].id
    _call_ok("get_weather", "".join(d.function.arguments or "" for d in deltas))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the call and its result go back into the prompt as text (BAGEL's understanding reads every message's text)
    back = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'}]
    reply = client.chat.completions.create(model="bagel", messages=back, tools=TOOLS, tool_choice="none", max_tokens=1)
    plain = client.chat.completions.create(model="bagel", messages=ASK, max_tokens=1)
    assert reply.choices[0].message.tool_calls is None
    assert reply.usage.prompt_tokens > plain.usage.prompt_tokens + len(call.function.arguments) + 18


def test_a_free_row_beside_a_constrained_one_replies_as_alone(client):
    def free():
        return client.chat.completions.create(model="bagel", messages=ASK, max_tokens=24, temperature=0.8, seed=5)

    def constrained():
        return client.chat.completions.create(model="bagel", messages=ASK, max_tokens=60, temperature=0.8, seed=5,
                                              response_format=_fmt())

    alone = free()
    with ThreadPoolExecutor(2) as pool:
        beside, mixed = pool.submit(constrained), pool.submit(free)
        beside, mixed = beside.result(), mixed.result()
    assert mixed.choices[0].message.content == alone.choices[0].message.content
    assert mixed.usage.completion_tokens == alone.usage.completion_tokens
    jsonschema.validate(json.loads(beside.choices[0].message.content), SCHEMA)
