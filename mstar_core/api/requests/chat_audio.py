"""Audio output in chat, as OpenAI's audio chat models give it: the request's `audio: {voice, format}` checked
against the adapter, and one `AudioReply` per choice collecting the spoken audio (encoded as asked) and its
transcript from the request's outputs.

Non-streamed, a choice's message carries `audio: {id, data (base64 of the whole file), expires_at, transcript}`;
streamed, its deltas carry `audio: {id, transcript}` and `audio: {id, data}` as they are produced, then one
`audio: {id, expires_at}`. The server keeps no audio for later turns, so `expires_at` is the creation time.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import Any

from mstar_core.api.http.errors import ApiError
from mstar_core.api.media.audio import AudioEncoder

#: `audio.format` -> the encoder's format: every format OpenAI names.
FORMATS = {"wav": "wav", "pcm16": "pcm", "flac": "flac", "mp3": "mp3", "opus": "opus", "aac": "aac"}
#: Formats whose bytes go out as they are made (a FLAC's header needs its length: sent whole).
STREAMABLE = ("wav", "pcm16", "mp3", "opus", "aac")


def wants_audio(body: Mapping[str, Any]) -> bool:
    """Whether a chat body asks for spoken output (`modalities` includes "audio")."""
    return "audio" in (body.get("modalities") or ())


def check_audio_request(adapter: Any, model: str, body: Any) -> dict[str, str] | None:
    """The request's `{voice, format}` when it asks for audio (checked against the adapter), else None."""
    asked = bool(body.modalities) and "audio" in body.modalities
    if not asked:
        if body.audio is not None:
            raise ApiError(400, "'audio' is set but 'modalities' does not include \"audio\"; send "
                                "modalities: [\"text\", \"audio\"] or drop 'audio'", param="audio")
        return None
    if getattr(adapter, "chat_audio_output", None) is None:
        raise ApiError(400, f"model '{model}' does not produce audio in chat; drop 'modalities'", param="modalities")
    if body.audio is None:
        raise ApiError(400, "'audio' is required with modalities [\"text\", \"audio\"]: {\"voice\": ..., "
                            "\"format\": \"wav\"}", param="audio")
    voice = body.audio.voice
    if isinstance(voice, Mapping):  # OpenAI's custom-voice form {"id": ...}
        voice = voice.get("id")
    voices = list(getattr(adapter, "voices", ()) or ())
    if not isinstance(voice, str) or not voice or (voices and voice not in voices):
        choose = f"choose one of: {', '.join(voices)}" if voices else "send a voice name"
        raise ApiError(400, f"voice {voice!r} is not available for model '{model}'; {choose}", param="audio.voice")
    fmt = body.audio.format
    if fmt not in FORMATS:
        raise ApiError(400, f"audio format '{fmt}' is not produced by this server; use one of: {', '.join(FORMATS)}",
                       param="audio.format")
    if body.stream and fmt not in STREAMABLE:
        raise ApiError(400, f"audio format '{fmt}' cannot be streamed; stream one of {', '.join(STREAMABLE)}",
                       param="audio.format")
    if body.n > 1:
        raise ApiError(400, "audio output takes one choice per request; drop 'n'", param="n")
    if body.stop:
        raise ApiError(400, "'stop' cannot cut audio already spoken; drop 'stop' with audio output", param="stop")
    return {"voice": voice, "format": fmt}


class AudioReply:
    """One choice's spoken reply: its audio encoded as asked, its transcript, and what is not reported yet."""

    def __init__(self, adapter: Any, fmt: str, *, stream: bool, on_first_audio: Callable[[], None] | None = None):
        self.id = f"audio_{uuid.uuid4().hex[:24]}"
        self.output: str = adapter.chat_audio_output
        self.transcript_output: str | None = getattr(adapter, "chat_transcript_output", None)
        self.adapter = adapter
        self.encoder = AudioEncoder(FORMATS[fmt], int(adapter.sample_rate), stream=stream)
        self.pending = bytearray()
        self.transcript = ""  # only when the transcript has its own output
        self.on_first_audio = on_first_audio

    def feed(self, out: Any) -> str | None:
        """Take an output if it is this reply's: returns the transcript piece it adds ("" for audio), None if not ours."""
        if out.name == self.output:
            pcm = self.adapter.audio_chunk(out.value)
            if pcm.size and self.encoder.samples == 0 and self.on_first_audio is not None:
                self.on_first_audio()
            self.pending += self.encoder.chunk(pcm)
            return ""
        if self.transcript_output is not None and out.name == self.transcript_output:
            piece = out.value if isinstance(out.value, str) else str(out.value)
            self.transcript += piece
            return piece
        return None

    def finish(self, env: Mapping[str, Any]) -> str:
        """The request ended: encode the rest; returns transcript text only the final env had."""
        self.pending += self.encoder.finish()
        if self.transcript_output is None or self.transcript:
            return ""
        value = (env or {}).get(self.transcript_output)
        text = "".join(value) if isinstance(value, list) else (value if isinstance(value, str) else "")
        self.transcript = text
        return text

    def take(self) -> bytes:
        """Audio bytes not reported yet (and mark them reported)."""
        data = bytes(self.pending)
        self.pending.clear()
        return data
