"""The `/v1/audio/speech` adapter for `qwen3-tts`: `input`, `voice` (a preset speaker, any case) and
`instructions` (voice design, or a style hint) become the model's request fields; the schema checks them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mstar_core.api.requests.adapters import ApiAdapter

_FORWARD = ("seed", "temperature", "top_p", "top_k", "repetition_penalty", "language", "max_frames",
            "non_streaming_mode", "do_sample", "subtalker_dosample")


class QwenTTSAdapter(ApiAdapter):
    model = "qwen3-tts"
    routes = {"speech"}
    sample_rate = 24000
    audio_output = "audio"

    def bind(self, loaded: Any) -> None:
        super().bind(loaded)
        self.sample_rate = int(loaded.extras.get("sample_rate", self.sample_rate))

    def speech_inputs(self, body: Mapping[str, Any]) -> dict[str, Any]:
        inputs: dict[str, Any] = {"input": body.get("input")}
        voice = body.get("voice")
        if voice:
            inputs["voice"] = str(voice).lower()
        if body.get("instructions"):
            inputs["instructions"] = body["instructions"]
        inputs.update({k: body[k] for k in _FORWARD if body.get(k) is not None})
        return inputs
