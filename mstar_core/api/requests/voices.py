"""Cloned voices (`/v1/audio/voices`): each caller's voices, bounded in count and bytes, scoped to its API key.

A voice is created once from reference audio: the model's adapter turns it into a prompt (`clone_voice`: a speaker
embedding, and with a transcript the reference codes) that the store keeps, so a speech request naming the voice
runs no encoder. A caller's bytes are its reference uploads plus the prompts kept (`prompt_bytes`). The scope is
the bearer token the request carried (a server without `--api-key` still separates callers by the token they send;
none is a scope of its own): a voice is invisible to, and unusable by, any other token. Voices live in the server's
memory; a restart forgets them.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from collections.abc import Mapping
from typing import Any

import attrs

from mstar_core.api.http.errors import ApiError

#: Defaults of the per-caller bounds (`MSTAR_MAX_VOICES`, `MSTAR_MAX_VOICE_BYTES` override them).
MAX_VOICES = 16
MAX_VOICE_BYTES = 64 * 1024 * 1024
#: The longest reference audio taken, in seconds (a few seconds suffice for a speaker embedding).
MAX_REFERENCE_SECONDS = 30.0
MAX_REFERENCE_BYTES = 8 * 1024 * 1024
ID_PREFIX = "voice_"


def caller_scope(headers: Mapping[str, str]) -> str:
    """The caller's scope: a digest of its bearer token (the token itself is never kept)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else ""
    return hashlib.sha256(token.encode()).hexdigest()


def prompt_bytes(value: Any) -> int:
    """The bytes a prompt holds, counted as packed data: 4 a number (an fp32 embedding value, an int32 code), a
    string's UTF-8 length; containers add nothing."""
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, Mapping):
        return sum(prompt_bytes(k) + prompt_bytes(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return sum(prompt_bytes(v) for v in value)
    return 4 if isinstance(value, int | float) else 0


@attrs.frozen
class Voice:
    id: str
    name: str
    model: str
    created_at: int
    transcript: str
    audio_bytes: int
    prompt: Mapping[str, Any] = attrs.field(repr=False)
    prompt_bytes: int = 0

    @property
    def bytes(self) -> int:
        return self.audio_bytes + self.prompt_bytes

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "object": "audio.voice", "name": self.name, "model": self.model,
                "created_at": self.created_at, "transcript": self.transcript or None, "audio_bytes": self.audio_bytes,
                "prompt_bytes": self.prompt_bytes}


@attrs.define
class VoiceStore:
    """Voices by scope; `add` refuses past `max_voices` voices or `max_bytes` of reference audio per scope."""

    max_voices: int = attrs.field(factory=lambda: int(os.environ.get("MSTAR_MAX_VOICES", MAX_VOICES)))
    max_bytes: int = attrs.field(factory=lambda: int(os.environ.get("MSTAR_MAX_VOICE_BYTES", MAX_VOICE_BYTES)))
    _voices: dict[str, dict[str, Voice]] = attrs.field(factory=dict)

    def room_for(self, scope: str, audio_bytes: int) -> None:
        """Raise the 4xx that `add` would for the upload alone, before any encoder runs (`add` counts the prompt too)."""
        mine = self._voices.get(scope, {})
        if len(mine) >= self.max_voices:
            raise ApiError(409, f"this API key already has {len(mine)} voices, the most this server keeps; delete "
                                f"one (DELETE /v1/audio/voices/{{id}})", param="file", code="voice_limit")
        used = sum(v.bytes for v in mine.values())
        if used + audio_bytes > self.max_bytes:
            raise ApiError(413, f"this API key's voices would hold {used + audio_bytes} bytes of reference audio and "
                                f"prompts; the limit is {self.max_bytes}", param="file", code="voice_limit")

    def add(self, scope: str, *, name: str, model: str, transcript: str, audio_bytes: int,
            prompt: Mapping[str, Any]) -> Voice:
        held = prompt_bytes(prompt)
        self.room_for(scope, audio_bytes + held)
        voice = Voice(id=ID_PREFIX + secrets.token_hex(12), name=name, model=model, created_at=int(time.time()),
                      transcript=transcript, audio_bytes=audio_bytes, prompt=prompt, prompt_bytes=held)
        self._voices.setdefault(scope, {})[voice.id] = voice
        return voice

    def list(self, scope: str) -> list[Voice]:
        return sorted(self._voices.get(scope, {}).values(), key=lambda v: (v.created_at, v.id))

    def get(self, scope: str, voice_id: str, param: str = "voice_id") -> Voice:
        voice = self._voices.get(scope, {}).get(voice_id)
        if voice is None:  # another key's voice is answered exactly as one that does not exist
            raise ApiError(404, f"no voice '{voice_id}' for this API key (GET /v1/audio/voices lists yours)",
                           param=param, code="voice_not_found")
        return voice

    def delete(self, scope: str, voice_id: str) -> Voice:
        voice = self.get(scope, voice_id)
        del self._voices[scope][voice_id]
        return voice


def is_voice_id(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(ID_PREFIX)
