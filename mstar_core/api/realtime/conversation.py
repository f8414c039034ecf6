"""A realtime session's conversation: items (messages, function calls and their outputs) in order, bounded,
and rendered into a model's chat inputs.

History rule: at most `max_items` items, `max_audio_seconds` of user audio and `max_bytes` of everything held
(decoded images and video frames, audio, text) are kept; when an item would pass a bound the oldest items are
dropped first (an item larger than `max_bytes` on its own is refused) (a dropped function call takes its output with it), so
the next prompt starts later and its first pages are computed again (the prefix cache keys on content).
An assistant message keeps the token ids the model generated for it, so the next turn's prompt holds exactly
the tokens the KV cache holds and only the new turn is prefilled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from mstar_core.api.media import AudioPart, ChatTurn, TextPart
from mstar_core.api.realtime.protocol import EventError, decode_pcm16, new_id
from mstar_core.api.requests import tools as tl

RATE = 24_000


@attrs.frozen
class TokensPart:
    """An assistant turn's text as the exact token ids the model generated (for adapters that take them)."""

    ids: tuple[int, ...]
    text: str


@attrs.define
class Item:
    """One conversation item; `to_json()` is its wire form (audio data is never echoed back)."""

    id: str
    type: str  # message | function_call | function_call_output
    role: str | None = None
    status: str = "completed"
    text: str = ""  # the message's text, or the transcript of its audio
    content_type: str = "input_text"  # input_text | input_audio | output_text | output_audio
    audio: np.ndarray | None = None  # user audio, int16 at 24 kHz
    ids: list[int] | None = None  # an assistant message's generated token ids, when the server made it
    media: list[Any] = attrs.field(factory=list)  # a user message's decoded images and videos, before its text
    name: str = ""
    call_id: str = ""
    arguments: str = ""
    output: str = ""
    #: an assistant audio message's (samples, chars, ids) at each audio delta, to truncate at what was heard
    marks: list[tuple[int, int, int]] = attrs.field(factory=list)

    def to_json(self) -> dict[str, Any]:
        base = {"id": self.id, "object": "realtime.item", "type": self.type, "status": self.status}
        if self.type == "function_call":
            return {**base, "name": self.name, "call_id": self.call_id, "arguments": self.arguments}
        if self.type == "function_call_output":
            return {**base, "call_id": self.call_id, "output": self.output}
        key = "transcript" if self.content_type.endswith("audio") else "text"
        part: dict[str, Any] = {"type": self.content_type, key: self.text}
        if self.content_type == "input_audio":
            # a model that hears the audio runs no transcription; a voice agent's ASR writes the item's text
            part["transcript"] = self.text or None
        visuals = [{"type": "input_video" if hasattr(m, "frames") else "input_image"} for m in self.media]
        return {**base, "role": self.role, "content": visuals + ([part] if self.text or self.audio is not None
                                                                  or self.content_type == "output_audio" else [])}

    @property
    def audio_seconds(self) -> float:
        return 0.0 if self.audio is None else self.audio.size / RATE

    @property
    def nbytes(self) -> int:
        """Bytes the item holds: audio, decoded media (RGB images, video frames and track) and text."""
        held = 0 if self.audio is None else self.audio.nbytes
        for part in self.media:
            frames, audio = getattr(part, "frames", None), getattr(part, "audio", None)
            if frames is not None:
                held += frames.nbytes + (audio.nbytes if audio is not None else 0)
            else:
                held += 3 * part.width * part.height
        return held + len(self.text) + len(self.output) + len(self.arguments) + sum(8 for _ in self.ids or ())

    def truncate_audio(self, samples: int) -> None:
        """Keep what the listener got of a spoken reply: the transcript and ids up to that much audio."""
        keep = [m for m in self.marks if m[0] <= samples]
        chars, ids = (keep[-1][1], keep[-1][2]) if keep else (0, 0)
        self.text = self.text[:chars]
        if self.ids is not None:
            self.ids = self.ids[:ids]
        self.marks = keep
        self.status = "incomplete"


def _content_parts(item: Mapping[str, Any], where: str) -> list[Mapping[str, Any]]:
    content = item.get("content")
    if not isinstance(content, Sequence) or isinstance(content, str) or not content:
        raise EventError(f"'{where}.content' must be a non-empty list of content parts", param=f"{where}.content")
    parts = []
    for i, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise EventError(f"'{where}.content[{i}]' must be an object", param=f"{where}.content[{i}]")
        parts.append(part)
    return parts


def item_from_client(data: Any, where: str, max_audio_bytes: int, *, takes_visual: bool = True) -> Item:
    """A `conversation.item.create` item checked: user/system/assistant messages, function calls and outputs.
    Images and video are refused before they decode when the model takes neither (`takes_visual`)."""
    if not isinstance(data, Mapping):
        raise EventError(f"'{where}' must be an object", param=where)
    kind = data.get("type", "message")
    item_id = data.get("id") or new_id("item")
    if not isinstance(item_id, str) or len(item_id) > 64:
        raise EventError(f"'{where}.id' must be a string of at most 64 characters", param=f"{where}.id")
    if kind == "function_call_output":
        if not isinstance(data.get("call_id"), str) or not isinstance(data.get("output"), str):
            raise EventError(f"'{where}' needs string 'call_id' and 'output'", param=f"{where}.call_id")
        return Item(item_id, kind, call_id=data["call_id"], output=data["output"])
    if kind == "function_call":
        if not isinstance(data.get("name"), str) or not isinstance(data.get("arguments", ""), str):
            raise EventError(f"'{where}' needs a string 'name' and 'arguments'", param=f"{where}.name")
        return Item(item_id, kind, name=data["name"], call_id=data.get("call_id") or new_id("call"),
                    arguments=data.get("arguments", ""))
    if kind != "message":
        raise EventError(f"'{where}.type' is {kind!r}; items are message, function_call or function_call_output",
                         param=f"{where}.type")
    role = data.get("role")
    allowed = {"user": ("input_text", "input_audio", "input_image", "input_video"), "system": ("input_text",),
               "assistant": ("output_text", "text", "output_audio")}
    if role not in allowed:
        raise EventError(f"'{where}.role' must be user, system or assistant", param=f"{where}.role")
    texts, audio, media = [], [], []
    content_type = "input_text" if role != "assistant" else "output_text"
    for i, part in enumerate(_content_parts(data, where)):
        ptype, at = part.get("type"), f"{where}.content[{i}]"
        if ptype not in allowed[role]:
            raise EventError(f"'{at}.type' is {ptype!r}; a {role} message takes {', '.join(allowed[role])}",
                             param=f"{at}.type")
        if ptype in ("input_image", "input_video"):
            if not takes_visual:
                key = "image_url" if ptype == "input_image" else "video_url"
                raise EventError(f"'{at}' is {ptype}, but this model does not take images or video; send text "
                                 "items", param=f"{at}.{key}", code="invalid_media")
            media.append(_visual(part, ptype, at))
            continue
        if ptype == "input_audio":
            audio.append(decode_pcm16(part.get("audio"), f"{at}.audio", max_audio_bytes))
            content_type = "input_audio"
            continue
        value = part.get("transcript") if ptype == "output_audio" else part.get("text")
        if not isinstance(value, str):
            raise EventError(f"'{at}.{'transcript' if ptype == 'output_audio' else 'text'}' must be a string",
                             param=at)
        texts.append(value)
    if audio and texts:
        raise EventError(f"'{where}.content' mixes text and audio; send them as two items", param=f"{where}.content")
    samples = np.concatenate(audio) if audio else None
    if samples is not None and samples.size < RATE // 10:
        raise EventError(f"'{where}' audio is {samples.size * 1000 // RATE} ms; send at least 100 ms",
                         param=f"{where}.content")
    if media and audio:
        raise EventError(f"'{where}.content' mixes audio with images or video; send them as two items",
                         param=f"{where}.content")
    return Item(item_id, "message", role=role, text="".join(texts), content_type=content_type, audio=samples,
                media=media)


def _visual(part: Mapping[str, Any], ptype: str, at: str) -> Any:
    """An `input_image` (`image_url`: a data URI) or `input_video` (`video_url`: a data URI) part, decoded."""
    from mstar_core.api.media.decode import ImagePart, MediaLimits, _data_uri, decode_image
    from mstar_core.api.media.video import video_part
    from mstar_core.errors import RequestError

    try:
        if ptype == "input_video":
            return video_part({"video_url": {"url": part.get("video_url"), "audio": bool(part.get("audio"))}}, at)
        limits = MediaLimits().with_env()
        url = part.get("image_url")
        if not isinstance(url, str):
            raise RequestError(f"'{at}.image_url' must be a data URI (data:image/png;base64,...)",
                               param=f"{at}.image_url")
        _, raw = _data_uri(url, at, "image/", limits.max_image_bytes)
        return ImagePart(decode_image(raw, at, limits), at)
    except RequestError as exc:
        raise EventError(str(exc), param=getattr(exc, "param", None) or at, code="invalid_media") from None


@attrs.define
class Conversation:
    """Items in order, bounded (see the module docstring)."""

    max_items: int = 100
    max_audio_seconds: float = 600.0
    max_bytes: int = 128 * 1024 * 1024
    items: list[Item] = attrs.field(factory=list)

    def find(self, item_id: Any, where: str = "item_id") -> Item:
        for item in self.items:
            if item.id == item_id:
                return item
        raise EventError(f"'{where}': no item {item_id!r} in this conversation", param=where, code="item_not_found")

    def add(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """Insert after `previous_item_id` (None: at the end; "root": first); returns the id before it."""
        if any(i.id == item.id for i in self.items):
            raise EventError(f"an item with id {item.id!r} already exists", param="item.id", code="duplicate_item_id")
        if item.nbytes > self.max_bytes:
            raise EventError(f"the item holds {item.nbytes} bytes decoded; a session's conversation holds at most "
                             f"{self.max_bytes}", param="item", code="item_too_large")
        at = len(self.items)
        if previous_item_id == "root":
            at = 0
        elif previous_item_id is not None:
            at = self.items.index(self.find(previous_item_id, "previous_item_id")) + 1
        self.items.insert(at, item)
        self._bound()
        # found by identity: comparing items by value would compare their fields (decoded media included)
        at = next((k for k, kept in enumerate(self.items) if kept is item), None)
        if at is None:
            return None
        return self.items[at - 1].id if at else None

    def delete(self, item_id: Any) -> None:
        self.items.remove(self.find(item_id))

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)

    def _bound(self) -> None:
        while (len(self.items) > self.max_items or sum(i.audio_seconds for i in self.items) > self.max_audio_seconds
               or self.nbytes > self.max_bytes):
            dropped = self.items.pop(0)
            if dropped.type == "function_call":
                self.items = [i for i in self.items if not (i.type == "function_call_output"
                                                            and i.call_id == dropped.call_id)]

    @property
    def last_id(self) -> str | None:
        return self.items[-1].id if self.items else None


# --- rendering into a chat model's inputs -------------------------------------------------------------------


def render(items: Sequence[Item], instructions: str, tools: Sequence[tl.Tool], fmt: str, *,
           takes_audio: bool, takes_tokens: bool, takes_visual: bool = False
           ) -> tuple[list[ChatTurn], list[dict[str, Any]]]:
    """The conversation as typed chat turns (for adapters that take parts) and as plain text messages.

    Tools, function calls and their outputs are written as chat writes them for the model's tool format `fmt`
    (`requests.tools`: the same system section, call text and tool-response turn); consecutive tool outputs
    share one turn.
    """
    system = tl.with_tools_prompt(instructions, list(tools), fmt) if tools else instructions
    turns: list[ChatTurn] = [ChatTurn("system", (TextPart(system),))] if system else []
    names: dict[str, str] = {}
    after_output = False  # the last turn holds tool outputs (the next one joins it)
    for item in items:
        joins, after_output = after_output, item.type == "function_call_output"
        if item.type == "function_call":
            names[item.call_id or ""] = item.name or ""
            arguments = json.dumps(_arguments(item.arguments))
            turns.append(ChatTurn("assistant", (TextPart(tl.call_text(item.name or "", arguments, fmt)),)))
        elif item.type == "function_call_output":
            part = TextPart(tl.result_text(item.output or "", names.get(item.call_id or "", ""), fmt))
            if joins:
                turns[-1] = ChatTurn("user", (*turns[-1].parts, TextPart("\n"), part))
            else:
                turns.append(ChatTurn("user", (part,)))
        elif item.audio is not None:
            if not takes_audio:
                raise EventError("this model does not take audio input; send text items", param="item.content",
                                 code="invalid_value")
            samples = item.audio.astype(np.float32) / 32768.0
            turns.append(ChatTurn(item.role or "user", (AudioPart(samples, RATE, f"item {item.id}", "pcm16"),)))
        elif item.media:
            if not takes_visual:
                raise EventError("this model does not take images or video; send text items", param="item.content",
                                 code="invalid_value")
            turns.append(ChatTurn(item.role or "user", (*item.media, *([TextPart(item.text)] if item.text else []))))
        elif item.role == "assistant" and takes_tokens and item.ids is not None:
            turns.append(ChatTurn("assistant", (TokensPart(tuple(item.ids), item.text),)))
        else:
            turns.append(ChatTurn(item.role or "user", (TextPart(item.text),)))
    plain = [{"role": t.role, "content": "".join(getattr(p, "text", "") for p in t.parts)} for t in turns]
    return turns, plain


def _arguments(raw: str) -> Any:
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return raw
