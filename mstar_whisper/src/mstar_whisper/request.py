"""A Whisper request's fields (16 kHz audio, language, task, timestamps, prompt, sampling) and the env they become."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mstar_core.errors import RequestError
from mstar_core.sampling import SamplingParams, sampling_names
from mstar_core.schema import RequestField, RequestSchema, sampling_fields
from mstar_whisper.config import WhisperTokens
from mstar_whisper.features import WhisperFeatures

_SAMPLING = sampling_names("temperature", "top_p", "top_k", "seed")
#: at most this much text per 30-second window (the decoder holds 448 positions, prompt included)
MAX_TOKENS = 224
MAX_SECONDS = 4 * 3600
EXAMPLE = {"audio": [0.0] * 1600, "language": "en", "max_tokens": 8}


def request_schema(tokens: WhisperTokens) -> RequestSchema:
    return RequestSchema(
        fields=(
            RequestField("audio", "tensor", "mono 16 kHz samples in [-1, 1]; over 30 s, Whisper's sequential long-form "
                         "(timestamps on)", required=True),
            RequestField("language", "string", "ISO-639-1 code of the spoken language; detected when left out",
                         choices=tuple(tokens.languages) or None),
            RequestField("task", "string", "transcribe, or translate into English", default="transcribe",
                         choices=("transcribe", "translate")),
            RequestField("timestamps", "boolean", "interleave timestamp tokens (segments)", default=False),
            RequestField("word_timestamps", "boolean", "each text token's start and end (`token_times`) from the "
                         "alignment heads' cross-attention", default=False),
            RequestField("prompt_ids", "array", "token ids of previous text to condition on", items="integer",
                         default=None, max_length=MAX_TOKENS - 1),
            RequestField("max_tokens", "integer", "the most tokens to write", default=MAX_TOKENS, minimum=1,
                         maximum=tokens.max_length // 2),
            *sampling_fields(*_SAMPLING),
        ),
        example=EXAMPLE,
        description="speech to text: one 30-second window of 16 kHz audio -> Whisper's tokens",
    )


class WhisperRequest:
    """`prepare(inputs)`: checked request fields -> the env the walks read."""

    def __init__(self, tokens: WhisperTokens, features: WhisperFeatures, vocab_size: int):
        self.tokens, self.features, self.vocab_size = tokens, features, vocab_size
        self.schema = request_schema(tokens)

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        t = self.tokens
        audio = inputs["audio"]
        if audio.dim() != 1 or not audio.is_floating_point() or audio.numel() < 400:
            raise RequestError("'audio' must be 1-D float samples at 16 kHz (at least 400 of them)", param="audio")
        seconds = audio.numel() / self.features.sampling_rate
        if seconds > MAX_SECONDS:
            raise RequestError(f"'audio' holds {seconds:.0f} s; at most {MAX_SECONDS} s per request", param="audio")
        long_form = audio.numel() > self.features.n_samples
        task = t.tasks.get(inputs["task"], -1)
        if inputs["task"] == "translate" and task < 0:
            raise RequestError("this checkpoint cannot translate (it has no <|translate|> token)", param="task")
        prev = list(inputs.get("prompt_ids") or [])
        if any(not 0 <= i < t.eot for i in prev):
            raise RequestError("'prompt_ids' must be text token ids (below end-of-text)", param="prompt_ids")
        fields = {k: inputs[k] for k in _SAMPLING if inputs.get(k) is not None}
        sampling = SamplingParams.from_mapping({**fields, "max_tokens": inputs["max_tokens"], "logprobs": 0,
                                                "stop_token_ids": (t.eot,)}).check_vocab(self.vocab_size)
        language = t.language_id(inputs.get("language"))
        env: dict[str, Any] = {}
        if long_form:  # the whole clip's log-mel (its own maximum), cut into windows by the longform walk
            mel = self.features.mel(audio.float())
            first = torch.nn.functional.pad(mel[:, : self.features.frames], (0, max(0, self.features.frames - mel.shape[1])))
            env = {"long_form": True, "mel": mel, "max_frames": mel.shape[1], "seek": 0, "input_features": first}
        return {
            "input_features": self.features(audio.float()),
            **env,
            "sot_ids": [t.sot],
            "sot_row": torch.tensor([0]),
            "language_token": -1 if language is None else language,
            "task_token": task,
            "timestamps": bool(inputs["timestamps"]) or long_form,
            "word_timestamps": bool(inputs["word_timestamps"]),
            # mel frames that hold audio (the rest of the window is padding the alignment leaves out)
            "content_frames": min(self.features.frames, audio.numel() // self.features.hop_length),
            "prev_ids": prev,
            "sampling": sampling,
            "audio_seconds": seconds,
        }
