"""Tool calling for the text routes: tools and tool_choice checked, tools and past calls written into the prompt in
the model family's own format, the grammar that enforces `required` / a named function, and the reply parsed back
into calls (whole, or as streamed deltas).

Formats: `hermes` (Qwen2 / Qwen3 / Qwen3-Omni and ChatML models: `<tool_call>\\n{"name": ..., "arguments": {...}}
\\n</tool_call>`, results as `<tool_response>` user turns) and `llama3_json` (Llama 3: a bare `{"name": ...,
"parameters": {...}}`, calls separated by `; `). A call whose JSON does not parse is returned as text starting with
`UNPARSED_MARKER`, never an error.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from mstar_core.api.http.errors import ApiError, from_request_error
from mstar_core.api.http.pieces import json_text
from mstar_core.api.requests.tool_parser import ToolCallStream
from mstar_core.errors import RequestError
from mstar_core.grammar.check import check_json_schema
from mstar_core.grammar.spec import GrammarSpec

FORMATS = ("hermes", "llama3_json")
#: Starts the text of a tool call the model wrote that did not parse (so a client can tell it from prose).
UNPARSED_MARKER = "[unparsed tool call] "
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@attrs.frozen
class Tool:
    name: str
    description: str
    parameters: Mapping[str, Any]

    def openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}


@attrs.frozen
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def check_tools(tools: Any, where: str = "tools", *, flat: bool = False) -> list[Tool]:
    """OpenAI's tools (`{type: function, function: {name, description?, parameters?}}`; `flat`: the Responses
    API's `{type: function, name, ...}`), each parameters schema checked; a 400 naming the tool's path."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ApiError(400, f"'{where}' must be a list of function tools", param=where)
    if len(tools) > MAX_TOOLS:
        raise ApiError(400, f"'{where}' has {len(tools)} tools; at most {MAX_TOOLS} are accepted", param=where)
    out: list[Tool] = []
    for i, tool in enumerate(tools):
        at = f"{where}[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, Mapping) else None
            raise ApiError(400, f"'{at}.type' is {kind!r}: only function tools are served", param=f"{at}.type")
        fn, fn_at = (tool, at) if flat else (tool.get("function"), f"{at}.function")
        if not isinstance(fn, Mapping):
            raise ApiError(400, f"'{fn_at}' must be an object {{name, description?, parameters?}}", param=fn_at)
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ApiError(400, f"'{fn_at}.name' must be 1 to 64 letters, digits, _ . or -", param=f"{fn_at}.name")
        if any(t.name == name for t in out):
            raise ApiError(400, f"'{fn_at}.name' {name!r} is given twice", param=f"{fn_at}.name")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, Mapping):
            raise ApiError(400, f"'{fn_at}.parameters' must be a JSON schema object", param=f"{fn_at}.parameters")
        try:
            check_json_schema(params, f"{fn_at}.parameters")
        except RequestError as exc:
            raise from_request_error(exc) from None
        out.append(Tool(name, str(fn.get("description") or ""), params))
    return out


def check_tool_choice(choice: Any, tools: list[Tool], where: str = "tool_choice") -> tuple[str, str | None]:
    """(mode, function name): mode is auto, none, required or function (a named one, which must be in `tools`)."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise ApiError(400, f"'{where}' is {choice!r}; use auto, none, required or "
                                '{"type": "function", "function": {"name": ...}}', param=where)
        if choice == "required" and not tools:
            raise ApiError(400, f"'{where}' is required but no tools are given", param=where)
        return choice, None
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        fn = choice.get("function") if isinstance(choice.get("function"), Mapping) else choice  # chat / Responses
        name = fn.get("name")
        if not any(t.name == name for t in tools):
            raise ApiError(400, f"'{where}' names function {name!r}, which is not among the tools "
                                f"({', '.join(t.name for t in tools) or 'none'})", param=where)
        return "function", name
    raise ApiError(400, f"'{where}' must be auto, none, required or a named function", param=where)


def tool_format(adapter: Any) -> str:
    """The family's format: Llama 3's JSON when the chat template speaks it, else the `<tool_call>` (hermes) one."""
    declared = getattr(adapter, "tool_format", None)
    if declared in FORMATS:
        return declared
    extras = getattr(getattr(adapter, "loaded", None), "extras", None) or {}
    template = extras.get("chat_template") or ""
    if "<tool_call>" not in template and ("<|python_tag|>" in template or "ipython" in template):
        return "llama3_json"
    return "hermes"


def system_prompt(tools: list[Tool], fmt: str) -> str:
    """The tools as the family's system-prompt section (what Qwen's and Llama 3's own templates write)."""
    # a description of megabytes is written a piece at a time (this runs in the off-loop pool: see json_text)
    specs = "\n".join(json_text(t.openai()) for t in tools)
    if fmt == "llama3_json":
        return ("You have access to the following functions. To call a function, respond with JSON of the form "
                '{"name": function name, "parameters": dictionary of argument name and its value}, and nothing '
                f"else.\n\n{specs}")
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
            f"function signatures within <tools></tools> XML tags:\n<tools>\n{specs}\n</tools>\n\nFor each function "
            "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def call_text(name: str, arguments: str, fmt: str) -> str:
    """A past call as the assistant wrote it in the family's format."""
    args = arguments if arguments.strip() else "{}"
    if fmt == "llama3_json":
        return f'{{"name": {json.dumps(name)}, "parameters": {args}}}'
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {args}}}\n</tool_call>'


def result_text(result: str, name: str, fmt: str) -> str:
    """A call's output as the user turn the family's template writes for the `tool` role."""
    if fmt == "hermes":
        return f"<tool_response>\n{result}\n</tool_response>"
    return f"Output of {name or 'the function'}: {result}"


def with_tools_prompt(system: str, tools: list[Tool], fmt: str) -> str:
    """A system prompt with the tools' section after it (the section alone when there is no prompt)."""
    section = system_prompt(tools, fmt)
    return system + "\n\n" + section if system else section


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or "" for p in content if isinstance(p, Mapping) and p.get("type") in ("text",
                                                                                                     "input_text",
                                                                                                     "output_text"))


def messages_for_model(messages: Sequence[Mapping[str, Any]], tools: list[Tool], fmt: str,
                       offer: bool) -> list[dict[str, Any]]:
    """Chat messages with the tools in the system prompt (when `offer`), assistant tool calls as the format's text and
    tool results as user turns: plain role/content messages any chat template renders."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for i, m in enumerate(messages):
        m = dict(m)
        calls = m.pop("tool_calls", None) or []
        if not isinstance(calls, list) or not all(isinstance(c, Mapping) and isinstance(c.get("function"), Mapping)
                                                  for c in calls):
            raise ApiError(400, f"'messages[{i}].tool_calls' must be a list of {{id, type: function, function: "
                                "{name, arguments}}", param=f"messages[{i}].tool_calls")
        if m.get("role") == "assistant" and calls:
            texts = []
            for call in calls:
                fn = call["function"]
                names[str(call.get("id"))] = str(fn.get("name", ""))
                texts.append(call_text(str(fn.get("name", "")), str(fn.get("arguments") or "{}"), fmt))
            body = _text(m.get("content"))
            m["content"] = (body + "\n" if body else "") + ("; " if fmt == "llama3_json" else "\n").join(texts)
        elif m.get("role") == "tool":
            name = names.get(str(m.get("tool_call_id")), "")
            m = {"role": "user", "content": result_text(_text(m.get("content")), name, fmt)}
        m.pop("tool_call_id", None)
        m.pop("name", None)
        out.append(m)
    if offer and tools:
        if out and out[0].get("role") in ("system", "developer"):
            out[0] = {**out[0], "content": with_tools_prompt(_text(out[0].get("content")), tools, fmt)}
        else:
            out.insert(0, {"role": "system", "content": with_tools_prompt("", tools, fmt)})
    return out


def tool_grammar(tools: list[Tool], fmt: str, mode: str, name: str | None, parallel: bool) -> GrammarSpec | None:
    """The structural tag that makes the reply's calls well formed: `required` / a named function must call (and
    call only tools that exist, with arguments that fit their schemas); `auto` may write text, and any call it
    opens is held to the same rules. None for `none`."""
    if mode == "none" or not tools:
        return None
    chosen = [t for t in tools if name is None or t.name == name]
    if fmt == "llama3_json":
        begin, end, sep, trigger = '{{"name": {}, "parameters": ', "}", "; ", '{"name": '
    else:
        begin, end, sep, trigger = '<tool_call>\n{{"name": {}, "arguments": ', "}\n</tool_call>", "\n", "<tool_call>"
    tags = [{"type": "tag", "begin": begin.format(json.dumps(t.name)),
             # at most one whitespace character between JSON tokens: a call is a finite walk, never a run of blanks
             "content": {"type": "json_schema", "json_schema": dict(t.parameters), "max_whitespace_cnt": 1},
             "end": end} for t in chosen]
    if mode == "auto":
        fmt_ = {"type": "triggered_tags", "triggers": [trigger], "tags": tags, "stop_after_first": not parallel}
    else:
        fmt_ = {"type": "tags_with_separator", "tags": tags, "separator": sep, "at_least_one": True,
                "stop_after_first": not parallel or mode == "function"}
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt_}))


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_reply(text: str, fmt: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole reply. Text outside calls is the content (None when there is none); a call that
    does not parse stays in the content behind `UNPARSED_MARKER`."""
    stream = ToolCalls(fmt)
    events = stream.feed(text) + stream.finish()
    content = "".join(e[1] for e in events if e[0] == "text")
    return (content if content.strip() else None), stream.calls


class ToolCalls:
    """Streams a reply as events: ("text", piece), ("start", index, id, name), ("arguments", index, piece) and
    ("end", index, valid) when a call is written out (not valid: it did not parse, its text follows as text).

    Hermes calls stream as the model writes them (`tool_call_parser.ToolCallStream`); Llama 3 JSON replies are
    held whole once they start like a call (a bare JSON object) and parsed at the end.
    """

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.calls: list[ToolCall] = []
        self.hermes = ToolCallStream() if fmt == "hermes" else None
        self.held = ""  # llama3_json: the reply so far, while it may be a call
        self.free = False  # llama3_json: the reply is prose

    def feed(self, piece: str) -> list[tuple]:
        if self.hermes is not None:
            return self._hermes(self.hermes.feed(piece))
        if self.free:
            return [("text", piece)] if piece else []
        self.held += piece
        stripped = self.held.lstrip()
        if stripped and not stripped.startswith(("{", "<|python_tag|>")):
            self.free, text, self.held = True, self.held, ""
            return [("text", text)]
        return []

    def finish(self) -> list[tuple]:
        if self.hermes is not None:
            return self._hermes(self.hermes.finish())
        text, self.held = self.held, ""
        if self.free or not text.strip():
            return [("text", text)] if text else []
        out: list[tuple] = []
        body, at, decoder = text.strip().removeprefix("<|python_tag|>"), 0, json.JSONDecoder()
        while at < len(body):  # objects one after another, separated by `;`
            try:
                obj, at = decoder.raw_decode(body, at)
            except ValueError:
                return [("text", UNPARSED_MARKER + text)]
            args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
                return [("text", UNPARSED_MARKER + text)]
            out.append((obj["name"], json.dumps(args, ensure_ascii=False)))
            while at < len(body) and body[at] in " \t\n;":
                at += 1
        events: list[tuple] = []
        for name, args in out:
            events += self._start(name) + [("arguments", len(self.calls) - 1, args), ("end", len(self.calls) - 1, True)]
            self.calls[-1] = attrs.evolve(self.calls[-1], arguments=args)
        return events

    def _start(self, name: str) -> list[tuple]:
        self.calls.append(ToolCall(new_call_id(), name, ""))
        return [("start", len(self.calls) - 1, self.calls[-1].id, name)]

    def _hermes(self, events: list[Any]) -> list[tuple]:
        out: list[tuple] = []
        for e in events:
            if e.kind == "text":
                out.append(("text", e.text))
            elif e.kind == "start" and e.name:
                out += self._start(e.name)
            elif e.kind == "arguments" and self.calls and self._open:
                out.append(("arguments", len(self.calls) - 1, e.text))
            elif e.kind == "end":
                if e.valid and e.name:
                    self.calls[-1] = attrs.evolve(self.calls[-1], arguments=e.text)
                    out.append(("end", len(self.calls) - 1, True))
                else:  # the model wrote a call that does not parse: its text, marked, and no call
                    if e.name and self.calls and self.calls[-1].name == e.name and not self.calls[-1].arguments:
                        out.append(("end", len(self.calls) - 1, False))
                        self.calls.pop()
                    head = f'{{"name": {json.dumps(e.name)}, "arguments": ' if e.name else ""
                    tail = "}" if e.name else ""
                    out.append(("text", UNPARSED_MARKER + f"<tool_call>\n{head}{e.text}{tail}\n</tool_call>"))
            self._open = e.kind in ("start", "arguments") and bool(self.calls)
        return out

    _open = False
