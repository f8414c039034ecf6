"""What the chat route does with `tools`, `tool_choice` and `parallel_tool_calls` (see `tools` for the formats)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mstar_core.api.http.errors import ApiError
from mstar_core.api.requests import tools as tl
from mstar_core.grammar.spec import GrammarSpec


class ChatTools:
    """One chat request's tools: its prompt messages, its grammar, and its reply as a message or streamed deltas."""

    def __init__(self, tools: list[tl.Tool], mode: str, name: str | None, parallel: bool, fmt: str):
        self.tools, self.mode, self.name, self.parallel, self.fmt = tools, mode, name, parallel, fmt
        self.streams: dict[int, tl.ToolCalls] = {}

    @classmethod
    def from_body(cls, body: Any, adapter: Any, grammar: GrammarSpec | None, *, flat: bool = False) -> ChatTools:
        """Checked from the body's `tools`, `tool_choice`, `parallel_tool_calls` (`flat`: the Responses API's tools)."""
        tools = tl.check_tools(getattr(body, "tools", None), "tools", flat=flat)
        mode, name = tl.check_tool_choice(getattr(body, "tool_choice", None), tools, "tool_choice")
        parallel = getattr(body, "parallel_tool_calls", None)
        if parallel is not None and not isinstance(parallel, bool):
            raise ApiError(400, "'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
        if grammar is not None and tools and mode != "none":
            field = "text.format" if flat else "response_format"
            raise ApiError(400, f"'{field}' other than text cannot be combined with tools; send tool_choice none or "
                                f"leave {field} out", param=field)
        return cls(tools, mode, name, parallel is not False, tl.tool_format(adapter))

    @property
    def active(self) -> bool:
        """Whether the reply is parsed for calls."""
        return bool(self.tools) and self.mode != "none"

    @property
    def grammar(self) -> GrammarSpec | None:
        return tl.tool_grammar(self.tools, self.fmt, self.mode, self.name, self.parallel)

    def messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        return tl.messages_for_model(messages, self.tools, self.fmt, offer=self.active)

    def message(self, text: str) -> dict[str, Any]:
        """The assistant message for a whole reply: its content and its `tool_calls`."""
        if not self.active:
            return {"role": "assistant", "content": text}
        content, calls = tl.parse_reply(text, self.fmt)
        out: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in calls]
        return out

    def deltas(self, index: int, text: str, done: bool) -> list[dict[str, Any]]:
        """Chat chunk deltas for a piece of choice `index`'s text: content, or tool_calls (name first, then arguments)."""
        stream = self.streams.setdefault(index, tl.ToolCalls(self.fmt))
        events = stream.feed(text) + (stream.finish() if done else [])
        out: list[dict[str, Any]] = []
        for event in events:
            if event[0] == "text" and event[1]:
                out.append({"content": event[1]})
            elif event[0] == "start":
                out.append({"tool_calls": [{"index": event[1], "id": event[2], "type": "function",
                                            "function": {"name": event[3], "arguments": ""}}]})
            elif event[0] == "arguments" and event[2]:
                out.append({"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]})
        return out

    def called(self, index: int) -> bool:
        stream = self.streams.get(index)
        return stream is not None and bool(stream.calls)
