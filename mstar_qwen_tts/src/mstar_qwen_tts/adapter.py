"""The speech adapter for `qwen3-tts`: `input`, `voice` (a preset speaker, any case; or a cloned voice, which the
speech route resolves to its prompt) and `instructions` (voice design, or a style hint) become the model's request
fields; the schema checks them. A Base checkpoint clones voices: `clone_voice` runs the speaker encoder once, when
`POST /v1/audio/voices` creates the voice, and, when the voice comes with its transcript, the speech tokenizer's
encoder too (the reference codes of the in-context prompt, as upstream's default `x_vector_only_mode=False`); speech
with that voice reuses the stored x-vector, transcript and codes, and runs neither encoder."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from mstar_core.api.media import resample
from mstar_core.api.requests.adapters import ApiAdapter
from mstar_core.errors import RequestError

_FORWARD = ("seed", "temperature", "top_p", "top_k", "repetition_penalty", "language", "max_frames",
            "non_streaming_mode", "do_sample", "subtalker_dosample", "ignore_eos")
#: The shortest reference audio taken (seconds): the x-vector of less is mostly noise.
MIN_REFERENCE_SECONDS = 0.5


class QwenTTSAdapter(ApiAdapter):
    model = "qwen3-tts"
    routes = {"speech"}
    sample_rate = 24000
    audio_output = "audio"

    def bind(self, loaded: Any) -> None:
        super().bind(loaded)
        self.sample_rate = int(loaded.extras.get("sample_rate", self.sample_rate))
        self.speaker_encoder = loaded.extras["model"].speaker_encoder
        self.speech_encoder = loaded.extras.get("speech_encoder")
        self.clones_voices = self.speaker_encoder is not None

    def speech_inputs(self, body: Mapping[str, Any]) -> dict[str, Any]:
        inputs: dict[str, Any] = {"input": body.get("input")}
        cloned = body.get("cloned_voice")
        if cloned is not None:
            inputs["speaker_embedding"] = list(cloned["speaker_embedding"])
            if cloned.get("ref_codes") is not None:  # created with its transcript: the in-context prompt
                inputs["ref_codes"], inputs["ref_text"] = list(cloned["ref_codes"]), cloned["ref_text"]
        elif body.get("voice"):
            inputs["voice"] = str(body["voice"]).lower()
        if body.get("instructions"):
            inputs["instructions"] = body["instructions"]
        inputs.update({k: body[k] for k in _FORWARD if body.get(k) is not None})
        return inputs

    def clone_voice(self, samples: np.ndarray, sample_rate: int, transcript: str) -> Mapping[str, Any]:
        if not self.clones_voices:
            raise RequestError(f"model '{self.model}' is not a Base checkpoint: it does not clone voices", param="model")
        rate = self.speaker_encoder.config.sample_rate
        wav = resample(samples, sample_rate, rate) if sample_rate != rate else np.asarray(samples, np.float32)
        if wav.size < MIN_REFERENCE_SECONDS * rate:
            raise RequestError(f"'file' holds {wav.size / rate:.2f} s of audio; a voice needs at least "
                               f"{MIN_REFERENCE_SECONDS:g} s", param="file")
        audio = torch.from_numpy(np.clip(wav, -1.0, 1.0))
        prompt: dict[str, Any] = {"speaker_embedding": self.speaker_encoder.embed(audio).float().tolist()}
        if transcript and self.speech_encoder is not None:
            # the tokenizer's encoder takes its own rate (24 kHz, as the speaker encoder's in the published files)
            codec_rate = self.speech_encoder.sample_rate
            if codec_rate != rate:
                audio = torch.from_numpy(np.clip(resample(samples, sample_rate, codec_rate), -1.0, 1.0))
            prompt["ref_codes"] = self.speech_encoder.encode(audio).flatten().tolist()
            prompt["ref_text"] = transcript
        return prompt
