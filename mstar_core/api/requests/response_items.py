"""The Responses API's side of the pipeline: its `input` items as chat messages, the response object as it grows,
and its event stream (created, in_progress, per output item added / delta / done, completed or incomplete)."""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from mstar_core.api.http.bodies import json_bytes
from mstar_core.api.http.errors import ApiError
from mstar_core.api.requests import choices as ch
from mstar_core.api.requests.chat_tools import ChatTools
from mstar_core.api.requests.schemas import ResponsesRequest
from mstar_core.api.requests.submit import stream_error_payload
from mstar_core.api.requests.tools import ToolCalls, new_call_id


def _content_parts(content: Any, at: str) -> str | list[dict[str, Any]]:
    """A message's content as chat content: text, or text and image_url parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"'{at}' must be a string or a list of content parts", param=at)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": str(part.get("text") or "")})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise ApiError(400, f"'{at}[{j}].image_url' must be a URL or data URI (file_id is not served)",
                               param=f"{at}[{j}].image_url")
            parts.append({"type": "image_url", "image_url": {"url": url, "detail": part.get("detail") or "auto"}})
        else:
            raise ApiError(400, f"'{at}[{j}].type' is {kind!r}; use input_text or input_image", param=f"{at}[{j}].type")
    return parts


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages (function calls as assistant tool_calls, their outputs as tool messages)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        at = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ApiError(400, f"'{at}.role' is {role!r}; use user, system, developer or assistant",
                               param=f"{at}.role")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _content_parts(item.get("content"), f"{at}.content")})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id") or new_call_id()), "type": "function",
                    "function": {"name": str(item.get("name") or ""), "arguments": str(item.get("arguments") or "{}")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""),
                        "content": output if isinstance(output, str) else json_bytes(output).decode()})
        else:
            raise ApiError(400, f"'{at}.type' is {kind!r}; use message, function_call or function_call_output",
                           param=f"{at}.type")
    if not out:
        raise ApiError(400, "'input' is empty", param="input")
    return out


def text_format(text: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` (flat: {type, name, schema, strict}) in chat's `response_format` shape; anything but an object
    (a bare "json_schema", say) is a 400 rather than silently plain text."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, Mapping):
        raise ApiError(400, "'text.format' must be an object such as {\"type\": \"json_schema\", \"name\": ..., "
                            f"\"schema\": {{...}}}}, got {type(fmt).__name__}", param="text.format")
    if fmt is None or fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {k: fmt.get(k) for k in ("name", "schema", "strict") if k in fmt}}


#: OpenAI's bounds on `metadata`: pairs, and characters of each key and value.
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
#: Characters of `user` (an end-user id, stored with the response).
USER_CHARS = 256


def check_stored_fields(metadata: Any, user: Any) -> None:
    """`metadata` within OpenAI's bounds (string keys and values) and `user` bounded: they are stored as sent, so
    unbounded they would let one client fill the response store. A 400 naming the field."""
    if metadata is not None:
        if not isinstance(metadata, Mapping) or len(metadata) > METADATA_PAIRS:
            raise ApiError(400, f"'metadata' takes at most {METADATA_PAIRS} key-value pairs", param="metadata")
        for key, value in metadata.items():
            if not isinstance(key, str) or len(key) > METADATA_KEY_CHARS:
                raise ApiError(400, f"'metadata' keys are strings of at most {METADATA_KEY_CHARS} characters; "
                                    f"{str(key)[:80]!r} is not", param="metadata")
            if not isinstance(value, str) or len(value) > METADATA_VALUE_CHARS:
                raise ApiError(400, f"'metadata.{key}' must be a string of at most {METADATA_VALUE_CHARS} "
                                    "characters", param=f"metadata.{key}")
    if user is not None and (not isinstance(user, str) or len(user) > USER_CHARS):
        raise ApiError(400, f"'user' must be a string of at most {USER_CHARS} characters", param="user")


class ResponseBuilder:
    """The response object as it grows: its output items, status and usage."""

    def __init__(self, body: ResponsesRequest, tools: ChatTools):
        self.id = f"resp_{uuid.uuid4().hex[:24]}"
        self.body, self.tools = body, tools
        self.created = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.usage: dict[str, Any] | None = None
        self.incomplete: dict[str, Any] | None = None

    def snapshot(self) -> dict[str, Any]:
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": self.status,
            "model": b.model, "output": copy.deepcopy(self.output), "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens, "temperature": b.temperature, "top_p": b.top_p,
            "tools": b.tools or [], "tool_choice": b.tool_choice or "auto",
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id, "store": b.store,
            "text": b.text or {"format": {"type": "text"}}, "truncation": "disabled",
            "metadata": b.metadata or {}, "user": b.user, "error": None,
            "incomplete_details": self.incomplete, "usage": self.usage,
        }

    def message_item(self) -> dict[str, Any]:
        item = {"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "status": "in_progress", "role": "assistant",
                "content": []}
        self.output.append(item)
        return item

    def call_item(self, call_id: str, name: str) -> dict[str, Any]:
        item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": call_id, "name": name,
                "arguments": "", "status": "in_progress"}
        self.output.append(item)
        return item

    def finish(self, choice: ch.Choice, adapter: Any) -> None:
        for item in self.output:
            item["status"] = "completed"
        if choice.finish_reason == "length":
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
            for item in self.output:
                item["status"] = "incomplete"
        else:
            self.status = "completed"
        u = ch.usage(adapter, [choice])
        self.usage = {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                      "total_tokens": u["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}

    def assistant_messages(self) -> list[dict[str, Any]]:
        """This response's output as chat messages, for the stored conversation."""
        text = "".join(p["text"] for item in self.output if item["type"] == "message" for p in item["content"])
        calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                          "arguments": item["arguments"]}}
                 for item in self.output if item["type"] == "function_call"]
        return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


def sse_event(kind: str, seq: int, **fields: Any) -> bytes:
    data = json_bytes({"type": kind, "sequence_number": seq, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


def whole_output(built: ResponseBuilder, tools: ChatTools, text: str) -> None:
    message = tools.message(text)
    if message.get("content"):
        built.message_item()["content"].append({"type": "output_text", "text": message["content"], "annotations": []})
    for call in message.get("tool_calls") or ():
        item = built.call_item(call["id"], call["function"]["name"])
        item["arguments"] = call["function"]["arguments"]


async def event_stream(built: ResponseBuilder, tools: ChatTools, choices: list[ch.Choice], adapter: Any,
                  keep: Any) -> AsyncIterator[bytes]:
    """The Responses event sequence: created, in_progress, then per output item its added / delta / done events,
    then completed (or incomplete); an error event if the generation fails."""
    seq = 0

    def ev(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        seq += 1
        return sse_event(kind, seq - 1, **fields)

    yield ev("response.created", response=built.snapshot())
    yield ev("response.in_progress", response=built.snapshot())
    text_item: dict[str, Any] | None = None
    calls: dict[int, dict[str, Any]] = {}
    stream = None if not tools.active else tools

    def close_text():
        nonlocal text_item
        if text_item is None:
            return []
        index, item = built.output.index(text_item), text_item
        part = item["content"][0]
        item["status"], text_item = "completed", None
        return [ev("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                   text=part["text"]),
                ev("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part),
                ev("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    def close_calls():
        out = []
        for item in calls.values():
            if item["status"] == "in_progress":
                index = built.output.index(item)
                item["status"] = "completed"
                out += [ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           arguments=item["arguments"]),
                        ev("response.output_item.done", output_index=index, item=copy.deepcopy(item))]
        return out

    try:
        async for choice, piece, _entries, done in ch.events(choices):
            events = [("text", piece)] if stream is None else _tool_events(stream, piece, done)
            for event in events:
                if event[0] == "text" and event[1]:
                    if text_item is None:
                        for data in close_calls():
                            yield data
                        text_item = built.message_item()
                        index = len(built.output) - 1
                        yield ev("response.output_item.added", output_index=index, item=copy.deepcopy(text_item))
                        part = {"type": "output_text", "text": "", "annotations": []}
                        text_item["content"].append(part)
                        yield ev("response.content_part.added", item_id=text_item["id"], output_index=index,
                                 content_index=0, part=dict(part))
                    text_item["content"][0]["text"] += event[1]
                    yield ev("response.output_text.delta", item_id=text_item["id"],
                             output_index=built.output.index(text_item), content_index=0, delta=event[1])
                elif event[0] == "start":
                    for data in close_text() + close_calls():
                        yield data
                    item = calls[event[1]] = built.call_item(event[2], event[3])
                    yield ev("response.output_item.added", output_index=len(built.output) - 1, item=copy.deepcopy(item))
                elif event[0] == "arguments" and event[2]:
                    item = calls[event[1]]
                    item["arguments"] += event[2]
                    yield ev("response.function_call_arguments.delta", item_id=item["id"],
                             output_index=built.output.index(item), delta=event[2])
            if done:
                for data in close_text() + close_calls():
                    yield data
                built.finish(choice, adapter)
        keep()
        kind = "response.completed" if built.status == "completed" else "response.incomplete"
        yield ev(kind, response=built.snapshot())
    except Exception as exc:
        built.status = "failed"
        yield ev("error", **stream_error_payload(exc)["error"])
        yield ev("response.failed", response=built.snapshot())
    finally:
        for c in choices:
            c.handle.cancel()


def _tool_events(tools: ChatTools, piece: str, done: bool) -> list[tuple]:
    stream = tools.streams.setdefault(0, ToolCalls(tools.fmt))
    return stream.feed(piece) + (stream.finish() if done else [])
