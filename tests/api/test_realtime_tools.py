"""A realtime session writes tools, calls and their outputs as chat does, in the model's own tool format (Llama 3's
JSON as well as Hermes' `<tool_call>`), and parses the reply with chat's parser."""

from __future__ import annotations

import json

import pytest

from mstar_core.api.realtime.conversation import Item, render
from mstar_core.api.requests import tools as tl

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize("fmt", tl.FORMATS)
def test_realtime_renders_what_chat_renders(fmt):
    tools = tl.check_tools([TOOL])
    items = [Item("u1", "message", role="user", text="Weather in Paris?"),
             Item("c1", "function_call", name="get_weather", call_id="k", arguments='{"city": "Paris"}'),
             Item("o1", "function_call_output", call_id="k", output='{"temp": 21}')]
    _, plain = render(items, "Be brief.", tools, fmt, takes_audio=False, takes_tokens=False)
    chat = tl.messages_for_model(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "k", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
         {"role": "tool", "tool_call_id": "k", "content": '{"temp": 21}'}], tools, fmt, offer=True)
    assert plain == chat


def test_a_llama3_json_reply_becomes_a_call_in_realtime_too():
    stream = tl.ToolCalls("llama3_json")
    events = stream.feed('{"name": "get_weather", "parameters": {"city": "Paris"}}') + stream.finish()
    kinds = [e[0] for e in events]
    assert kinds == ["start", "arguments", "end"] and events[-1][2] is True
    assert json.loads(events[1][2]) == {"city": "Paris"}
