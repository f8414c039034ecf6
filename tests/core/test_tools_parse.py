"""Tool-call parsing and prompting per family (hermes `<tool_call>`, Llama 3 JSON), without a model."""

from __future__ import annotations

import json

import pytest

from mstar_core.api.http.errors import ApiError
from mstar_core.api.requests.tools import (
    UNPARSED_MARKER,
    ToolCalls,
    check_tool_choice,
    check_tools,
    messages_for_model,
    parse_reply,
)

HERMES = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')


def test_hermes_whole_and_streamed_agree():
    content, calls = parse_reply(HERMES, "hermes")
    assert content == "Sure.\n" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("f", {"x": 1})]
    stream = ToolCalls("hermes")
    events = [e for i in range(0, len(HERMES), 3) for e in stream.feed(HERMES[i:i + 3])] + stream.finish()
    names = [e[3] for e in events if e[0] == "start"]
    args = {i: "".join(e[2] for e in events if e[0] == "arguments" and e[1] == i) for i in range(2)}
    assert names == ["get_weather", "f"] and [json.loads(args[0]), json.loads(args[1])] == [{"city": "Paris"}, {"x": 1}]


def test_llama3_json_calls_and_prose():
    content, calls = parse_reply('{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}', "llama3_json")
    assert content is None and [c.name for c in calls] == ["f", "g"]
    assert parse_reply("Hello there", "llama3_json") == ("Hello there", [])


def test_unparsable_calls_come_back_as_marked_text():
    content, calls = parse_reply('<tool_call>\n{"name": "f", "arguments": {"x": }\n</tool_call>', "hermes")
    assert calls == [] and content.startswith(UNPARSED_MARKER)
    content, calls = parse_reply('{"name": "f", "parameters": {"x": 1', "llama3_json")
    assert calls == [] and content.startswith(UNPARSED_MARKER)


def test_history_becomes_text_and_bad_shapes_are_400s():
    tools = check_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    out = messages_for_model([{"role": "user", "content": "hi"},
                              {"role": "assistant", "content": None,
                               "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f",
                                                                                           "arguments": "{}"}}]},
                              {"role": "tool", "tool_call_id": "a", "content": "5"}], tools, "hermes", True)
    assert out[0]["role"] == "system" and "<tools>" in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert out[3] == {"role": "user", "content": "<tool_response>\n5\n</tool_response>"}
    with pytest.raises(ApiError, match=r"messages\[0\]\.tool_calls"):
        messages_for_model([{"role": "assistant", "tool_calls": "x"}], [], "hermes", False)
    with pytest.raises(ApiError, match=r"tools\[0\]\.function\.parameters' must be"):
        check_tools([{"type": "function", "function": {"name": "f", "parameters": True}}])
    with pytest.raises(ApiError, match="not among the tools"):
        check_tool_choice({"type": "function", "function": {"name": "g"}}, tools)
