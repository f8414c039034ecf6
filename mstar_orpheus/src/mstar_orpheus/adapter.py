"""The `/v1/audio/speech` adapter: an OpenAI speech body -> Orpheus raw inputs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mstar_core.errors import RequestError
from mstar_orpheus.prompt import VOICES


class OrpheusSpeechAdapter:
    """Serves `speech` for model `orpheus`; duck-types `mstar_core.api.adapters.ApiAdapter`."""

    model = "orpheus"
    routes = {"speech"}
    voices = list(VOICES)
    sample_rate = 24000
    audio_output = "audio"
    supports_speed = False

    def bind(self, loaded: Any) -> None:
        """Take voices and sample rate from the loaded model."""
        self.loaded = loaded
        self.voices = list(loaded.extras.get("voices", self.voices))
        self.sample_rate = int(loaded.extras.get("sample_rate", self.sample_rate))

    def speech_inputs(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """`input` -> text, `voice` -> voice (checked), optional `max_tokens`/`seed`/sampling extras."""
        text = body.get("input")
        if not isinstance(text, str) or not text.strip():
            raise RequestError("'input' must be a non-empty string: the text to speak")
        voice = body.get("voice", self.voices[0])
        if voice not in self.voices:
            raise RequestError(f"unknown voice {voice!r} for model 'orpheus'; choose one of {', '.join(self.voices)}")
        speed = body.get("speed")
        if speed not in (None, 1, 1.0):
            raise RequestError("model 'orpheus' does not support 'speed'; omit it or send 1.0")
        inputs: dict[str, Any] = {"text": text, "voice": voice}
        for key in ("max_tokens", "seed", "temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if body.get(key) is not None:
                inputs[key] = body[key]
        return inputs
