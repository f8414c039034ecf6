"""The `/v1/audio/speech` adapter: an OpenAI speech body renamed to Orpheus' request fields (checked by its schema)."""

from __future__ import annotations

from typing import Any

from mstar_core.api.requests.adapters import ApiAdapter


class OrpheusSpeechAdapter(ApiAdapter):
    """Serves `speech` for model `orpheus`: `input` -> `text`; voices, bounds and sampling are the schema's."""

    model = "orpheus"
    routes = {"speech"}
    request_fields = {"speech": {"input": "text", "voice": "voice"}}
    sample_rate = 24000
    audio_output = "audio"

    def bind(self, loaded: Any) -> None:
        """Take the sample rate from the loaded model."""
        super().bind(loaded)
        self.sample_rate = int(loaded.extras.get("sample_rate", self.sample_rate))
