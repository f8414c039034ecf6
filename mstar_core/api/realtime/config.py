"""A realtime session's settings (`session.update`) and a response's overrides (`response.create`), checked
strictly: an unknown key or a bad value raises `EventError` naming it (`session.audio.output.voice`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from mstar_core.api.realtime.protocol import EventError
from mstar_core.errors import RequestError
from mstar_core.sampling import check_openai

RATE = 24_000
PCM = {"type": "audio/pcm", "rate": RATE}
MAX_OUTPUT_TOKENS = 4096


@attrs.frozen
class FunctionChoice:
    """`tool_choice: {"type": "function", "name": NAME}`: the reply must call this one function."""

    name: str

    def to_json(self) -> dict[str, str]:
        return {"type": "function", "name": self.name}


#: A session's or response's `tool_choice`: "auto", "none", "required", or one function.
ToolChoice = str | FunctionChoice


@attrs.frozen
class TurnDetection:
    """`server_vad` settings (OpenAI's defaults)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"type": "server_vad", **attrs.asdict(self), "idle_timeout_ms": None}


@attrs.frozen
class SessionConfig:
    """What `session.created` reports and `session.update` changes."""

    model: str
    output_modalities: tuple[str, ...] = ("audio",)
    voice: str | None = None
    instructions: str = ""
    turn_detection: TurnDetection | None = TurnDetection()
    max_output_tokens: int | None = None
    temperature: float | None = None
    tools: tuple[Mapping[str, Any], ...] = ()
    tool_choice: ToolChoice = "auto"

    def to_json(self, session_id: str) -> dict[str, Any]:
        return {
            "type": "realtime", "object": "realtime.session", "id": session_id, "model": self.model,
            "output_modalities": list(self.output_modalities), "instructions": self.instructions,
            "audio": {"input": {"format": dict(PCM), "turn_detection": self.turn_detection and
                                self.turn_detection.to_json(), "transcription": None, "noise_reduction": None},
                      "output": {"format": dict(PCM), "voice": self.voice, "speed": 1.0}},
            "max_output_tokens": "inf" if self.max_output_tokens is None else self.max_output_tokens,
            "tools": [dict(t) for t in self.tools],
            "tool_choice": self.tool_choice.to_json() if isinstance(self.tool_choice, FunctionChoice) else self.tool_choice,
            "tracing": None,
            "truncation": "auto", "prompt": None, "include": None,
        }


#: session keys accepted and ignored (they change nothing this server does): tracing, include, ...
_IGNORED = {"type", "tracing", "include", "prompt", "truncation", "parallel_tool_calls", "model", "reasoning"}
_SESSION_KEYS = {"output_modalities", "instructions", "audio", "max_output_tokens", "temperature", "tools",
                 "tool_choice", "modalities", "voice", "turn_detection"} | _IGNORED


def _unknown(data: Mapping[str, Any], known: set[str], where: str) -> None:
    extra = sorted(set(data) - known)
    if extra:
        raise EventError(f"unknown field '{where}.{extra[0]}'; known: {', '.join(sorted(known))}",
                         param=f"{where}.{extra[0]}")


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise EventError(f"'{where}' must be an object", param=where)
    return value


def check_format(value: Any, where: str) -> None:
    """Only pcm16 at 24 kHz travels here (`{"type": "audio/pcm", "rate": 24000}`)."""
    fmt = {"type": value} if isinstance(value, str) else _mapping(value, where)
    kind, rate = fmt.get("type"), fmt.get("rate", RATE)
    if kind not in ("audio/pcm", "pcm16") or rate != RATE:
        raise EventError(f"'{where}' is {dict(fmt)}; this server takes and sends pcm16 at 24 kHz only: "
                         '{"type": "audio/pcm", "rate": 24000}', param=where, code="invalid_value")


def modalities(value: Any, where: str, speaks: bool) -> tuple[str, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str) or not value or not set(value) <= {"text", "audio"}:
        raise EventError(f"'{where}' must be [\"audio\"] (speech and its transcript) or [\"text\"]", param=where)
    if "audio" in value and not speaks:
        raise EventError(f"'{where}': this model does not speak; use [\"text\"]", param=where)
    return ("audio",) if "audio" in value else ("text",)


def voice(value: Any, where: str, voices: Sequence[str]) -> str:
    name = value.get("id") if isinstance(value, Mapping) else value
    if not isinstance(name, str) or (voices and name.lower() not in voices):
        raise EventError(f"'{where}' is {value!r}; this model's voices: {', '.join(voices) or 'any name'}",
                         param=where, code="invalid_value")
    return name.lower()


def max_tokens(value: Any, where: str) -> int | None:
    if value == "inf" or value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_OUTPUT_TOKENS:
        raise EventError(f"'{where}' must be an integer in [1, {MAX_OUTPUT_TOKENS}] or \"inf\"", param=where)
    return value


def temperature(value: Any, where: str) -> float | None:
    """OpenAI's temperature bounds, as the declaration of the sampling fields has them (`check_openai`)."""
    try:
        checked = check_openai("temperature", value, where)
    except RequestError as exc:
        raise EventError(str(exc), param=where) from None
    return None if checked is None else float(checked)


def tools(value: Any, where: str) -> tuple[Mapping[str, Any], ...]:
    """Function tools, checked as chat's are (at most `MAX_TOOLS`, names, each parameters schema's size and
    nesting); an EventError naming the tool's path."""
    from mstar_core.api.http.errors import ApiError
    from mstar_core.api.requests.tools import MAX_TOOLS, check_tools

    if not isinstance(value, Sequence) or isinstance(value, str):
        raise EventError(f"'{where}' must be a list of function tools", param=where)
    if len(value) > MAX_TOOLS:
        raise EventError(f"'{where}' has {len(value)} tools; at most {MAX_TOOLS} are accepted", param=where)
    out = []
    for i, tool in enumerate(value):
        tool = _mapping(tool, f"{where}[{i}]")
        _unknown(tool, {"type", "name", "description", "parameters"}, f"{where}[{i}]")
        if tool.get("type", "function") != "function":
            raise EventError(f"'{where}[{i}].type' is {tool.get('type')!r}; only function tools are served",
                             param=f"{where}[{i}].type")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise EventError(f"'{where}[{i}].name' must be a non-empty string", param=f"{where}[{i}].name")
        params = tool.get("parameters", {"type": "object", "properties": {}})
        _mapping(params, f"{where}[{i}].parameters")
        out.append({"type": "function", "name": tool["name"], "description": tool.get("description") or "",
                    "parameters": dict(params)})
    try:
        check_tools(out, where, flat=True)
    except ApiError as exc:
        raise EventError(exc.message, param=exc.param) from None
    return tuple(out)


def tool_choice(value: Any, where: str) -> ToolChoice:
    """auto, none, required, or one function by name (`{type: function, name}`, as OpenAI's realtime API takes it)."""
    if isinstance(value, str) and value in ("auto", "none", "required"):
        return value
    if isinstance(value, Mapping) and value.get("type") == "function":
        _unknown(value, {"type", "name"}, where)
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise EventError(f"'{where}.name' must be the name of one of the tools", param=f"{where}.name")
        return FunctionChoice(name)
    raise EventError(f"'{where}' must be auto, none, required or {{\"type\": \"function\", \"name\": ...}}",
                     param=where)


def chosen_function(choice: ToolChoice) -> str | None:
    """The function a named `tool_choice` asks for (None for auto, none and required)."""
    return choice.name if isinstance(choice, FunctionChoice) else None


def turn_detection(value: Any, where: str, current: TurnDetection | None) -> TurnDetection | None:
    if value is None:
        return None
    data = _mapping(value, where)
    _unknown(data, {"type", "threshold", "prefix_padding_ms", "silence_duration_ms", "create_response",
                    "interrupt_response", "idle_timeout_ms"}, where)
    if data.get("type", "server_vad") != "server_vad":
        raise EventError(f"'{where}.type' is {data.get('type')!r}; this server detects turns with server_vad "
                         "(or null: the client commits)", param=f"{where}.type")
    base = current or TurnDetection()
    changes: dict[str, Any] = {}
    if "threshold" in data:
        t = data["threshold"]
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t <= 1:
            raise EventError(f"'{where}.threshold' must be a number in [0, 1]", param=f"{where}.threshold")
        changes["threshold"] = float(t)
    for key, top in (("prefix_padding_ms", 10_000), ("silence_duration_ms", 10_000)):
        if key in data:
            v = data[key]
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= top:
                raise EventError(f"'{where}.{key}' must be an integer in [0, {top}]", param=f"{where}.{key}")
            changes[key] = v
    for key in ("create_response", "interrupt_response"):
        if key in data:
            if not isinstance(data[key], bool):
                raise EventError(f"'{where}.{key}' must be true or false", param=f"{where}.{key}")
            changes[key] = data[key]
    return attrs.evolve(base, **changes)


def update_session(config: SessionConfig, data: Any, *, speaks: bool, voices: Sequence[str],
                   voice_locked: bool) -> SessionConfig:
    """`config` with a `session.update`'s `session` object applied (all or nothing)."""
    data = _mapping(data, "session")
    _unknown(data, _SESSION_KEYS, "session")
    changes = _reply_settings(data, "session", speaks)
    if "turn_detection" in data:  # the beta form, still sent by some clients
        changes["turn_detection"] = turn_detection(data["turn_detection"], "session.turn_detection",
                                                   config.turn_detection)
    new_voice = data.get("voice")
    audio = data.get("audio")
    if audio is not None:
        audio = _mapping(audio, "session.audio")
        _unknown(audio, {"input", "output"}, "session.audio")
        inp = _mapping(audio.get("input") or {}, "session.audio.input")
        _unknown(inp, {"format", "turn_detection", "transcription", "noise_reduction"}, "session.audio.input")
        if "format" in inp:
            check_format(inp["format"], "session.audio.input.format")
        if "turn_detection" in inp:
            changes["turn_detection"] = turn_detection(inp["turn_detection"], "session.audio.input.turn_detection",
                                                       config.turn_detection)
        if inp.get("transcription") is not None:
            raise EventError("'session.audio.input.transcription' is not offered (the model hears the audio "
                             "itself; POST /v1/audio/transcriptions transcribes)", param="session.audio.input.transcription")
        out = _mapping(audio.get("output") or {}, "session.audio.output")
        _unknown(out, {"format", "voice", "speed"}, "session.audio.output")
        if "format" in out:
            check_format(out["format"], "session.audio.output.format")
        if out.get("speed", 1.0) != 1.0:
            raise EventError("'session.audio.output.speed' other than 1.0 is not offered", param="session.audio.output.speed")
        if "voice" in out:
            new_voice = out["voice"]
    if new_voice is not None:
        name = voice(new_voice, "session.audio.output.voice", voices)
        if voice_locked and name != config.voice:
            raise EventError("the voice cannot change once the model has spoken in this session",
                             param="session.audio.output.voice", code="invalid_value")
        changes["voice"] = name
    return _chosen_among_tools(attrs.evolve(config, **changes), "session")


@attrs.frozen
class ResponseOptions:
    """One response's settings: the session's, with `response.create`'s overrides."""

    output_modalities: tuple[str, ...]
    voice: str | None
    instructions: str
    max_output_tokens: int | None
    temperature: float | None
    tools: tuple[Mapping[str, Any], ...]
    tool_choice: ToolChoice
    conversation: str = "auto"  # "none": an out-of-band response, not added to the conversation
    input: tuple[Mapping[str, Any], ...] | None = None  # the items it reads instead of the conversation
    metadata: Mapping[str, Any] | None = None


_RESPONSE_KEYS = {"output_modalities", "modalities", "instructions", "max_output_tokens", "temperature", "tools",
                  "tool_choice", "audio", "conversation", "input", "metadata", "voice", "prompt", "reasoning",
                  "parallel_tool_calls"}


def response_options(config: SessionConfig, data: Any, *, speaks: bool, voices: Sequence[str]) -> ResponseOptions:
    """A `response.create`'s `response` object over the session's settings."""
    base = ResponseOptions(config.output_modalities, config.voice, config.instructions, config.max_output_tokens,
                           config.temperature, config.tools, config.tool_choice)
    if data is None:
        return base
    data = _mapping(data, "response")
    _unknown(data, _RESPONSE_KEYS, "response")
    changes = _reply_settings(data, "response", speaks)
    audio = data.get("audio")
    if audio is not None:
        out = _mapping(_mapping(audio, "response.audio").get("output") or {}, "response.audio.output")
        if "format" in out:
            check_format(out["format"], "response.audio.output.format")
        if "voice" in out:
            changes["voice"] = voice(out["voice"], "response.audio.output.voice", voices)
    if "conversation" in data:
        if data["conversation"] not in ("auto", "none"):
            raise EventError("'response.conversation' must be auto or none", param="response.conversation")
        changes["conversation"] = data["conversation"]
    if data.get("input") is not None:
        if not isinstance(data["input"], Sequence) or isinstance(data["input"], str):
            raise EventError("'response.input' must be a list of items", param="response.input")
        changes["input"] = tuple(data["input"])
    if data.get("metadata") is not None:
        changes["metadata"] = dict(_mapping(data["metadata"], "response.metadata"))
    return _chosen_among_tools(attrs.evolve(base, **changes), "response")


def _chosen_among_tools(settings: Any, where: str) -> Any:
    """`settings` (a session's or a response's) once a named `tool_choice` is known to name one of its tools."""
    name = chosen_function(settings.tool_choice)
    names = [t.get("name") for t in settings.tools]
    if name is not None and name not in names:
        raise EventError(f"'{where}.tool_choice.name' is {name!r}, not one of the tools ({', '.join(names) or 'none'})",
                         param=f"{where}.tool_choice.name")
    return settings


def _reply_settings(data: dict[str, Any], where: str, speaks: bool) -> dict[str, Any]:
    """The settings a session and a response both take (modalities, instructions, limits, tools), checked."""
    changes: dict[str, Any] = {}
    if "output_modalities" in data or "modalities" in data:
        key = "output_modalities" if "output_modalities" in data else "modalities"  # the GA name wins
        changes["output_modalities"] = modalities(data[key], f"{where}.{key}", speaks)
    if "instructions" in data:
        if not isinstance(data["instructions"], str):
            raise EventError(f"'{where}.instructions' must be a string", param=f"{where}.instructions")
        changes["instructions"] = data["instructions"]
    if "max_output_tokens" in data:
        changes["max_output_tokens"] = max_tokens(data["max_output_tokens"], f"{where}.max_output_tokens")
    if "temperature" in data:
        changes["temperature"] = temperature(data["temperature"], f"{where}.temperature")
    if "tools" in data:
        changes["tools"] = tools(data["tools"], f"{where}.tools")
    if "tool_choice" in data:
        changes["tool_choice"] = tool_choice(data["tool_choice"], f"{where}.tool_choice")
    return changes
