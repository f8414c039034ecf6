"""Streaming parser for tool calls in the Qwen / Hermes chat format:
`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>` inside a reply's text.

`ToolCallStream.feed(delta)` returns what the new text settles, as `ToolEvent`s: plain text outside calls,
`start` (a call's name is known), `arguments` (a piece of its arguments JSON, streamed as the model writes
it), and `end` (the call closed: the whole arguments text and whether it parsed as JSON). Text is held back
only while it could still be the start of a tag or the end of a call. Used by the realtime session; any
route that turns Qwen-format tool calls into function-call items can reuse it.
"""

from __future__ import annotations

import json
import re

import attrs

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@attrs.frozen
class ToolEvent:
    """`kind`: text | start | arguments | end; `name` on start and end; `valid` on end (arguments are JSON)."""

    kind: str
    text: str = ""
    name: str = ""
    valid: bool = True


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@attrs.define
class ToolCallStream:
    """Splits streamed reply text into plain text and tool calls (see the module docstring)."""

    buffer: str = ""
    in_call: bool = False
    name: str | None = None  # the current call's name, once its head parsed
    sent_args: str = ""
    calls: int = 0

    def feed(self, delta: str) -> list[ToolEvent]:
        self.buffer += delta
        out: list[ToolEvent] = []
        while True:
            if not self.in_call:
                at = self.buffer.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self.buffer, OPEN)
                    text, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                    if text:
                        out.append(ToolEvent("text", text))
                    return out
                if at:
                    out.append(ToolEvent("text", self.buffer[:at]))
                self.buffer, self.in_call, self.name, self.sent_args = self.buffer[at + len(OPEN):], True, None, ""
                continue
            end = self.buffer.find(CLOSE)
            body = self.buffer if end < 0 else self.buffer[:end]
            out.extend(self._stream_args(body, final=end >= 0))
            if end < 0:
                return out
            self.buffer, self.in_call = self.buffer[end + len(CLOSE):].lstrip("\n"), False

    def finish(self) -> list[ToolEvent]:
        """The reply ended: settle held text, and a call the model never closed."""
        if not self.in_call:
            text, self.buffer = self.buffer, ""
            return [ToolEvent("text", text)] if text else []
        events = self._stream_args(self.buffer, final=True)
        self.buffer, self.in_call = "", False
        return events

    def _stream_args(self, body: str, *, final: bool) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        if self.name is None:
            head = _HEAD.match(body)
            if head is None:
                if final:  # not the usual key order: parse the whole object
                    return self._whole(body)
                return out
            self.name = json.loads(f'"{head.group(1)}"')
            out.append(ToolEvent("start", name=self.name))
        head = _HEAD.match(body)
        args = body[head.end():] if head else ""
        if final:
            args = args.rstrip()
            args = args[:-1].rstrip() if args.endswith("}") else args  # the wrapper object's closing brace
        else:
            args = args[: len(args) - self._held(args)]
        if len(args) > len(self.sent_args) and args.startswith(self.sent_args):
            out.append(ToolEvent("arguments", args[len(self.sent_args):]))
            self.sent_args = args
        if final:
            out.append(ToolEvent("end", self.sent_args, self.name, _is_json(self.sent_args)))
            self.calls += 1
        return out

    @staticmethod
    def _held(args: str) -> int:
        """Characters at the end that may be the wrapper's `}` and the closing tag's start (not arguments yet)."""
        rest = args[: len(args) - _partial_suffix(args, CLOSE)].rstrip()
        rest = rest[:-1] if rest.endswith("}") else rest
        return len(args) - len(rest)

    def _whole(self, body: str) -> list[ToolEvent]:
        try:
            obj = json.loads(body)
            name, args = str(obj["name"]), obj.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            self.calls += 1
            return [ToolEvent("start", name=""), ToolEvent("arguments", body.strip()),
                    ToolEvent("end", body.strip(), "", False)]
        text = args if isinstance(args, str) else json.dumps(args)
        self.calls += 1
        return [ToolEvent("start", name=name), ToolEvent("arguments", text), ToolEvent("end", text, name, _is_json(text))]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False
