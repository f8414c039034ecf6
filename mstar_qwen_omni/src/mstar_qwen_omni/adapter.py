"""OpenAI routes for `qwen3-omni`: chat (text in; text, and speech with `modalities: ["text", "audio"]`) and
`/v1/audio/speech`.

Qwen3-Omni is not a text-to-speech model: it speaks what its Thinker answers. `/v1/audio/speech` therefore
asks it to read the input aloud (the published speech system prompt, then `Read this aloud exactly: ...`)
and returns the spoken answer; a trained checkpoint repeats the text, the tiny preset speaks noise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from mstar_core.api.media import AudioPart, ImagePart, MediaLimits, TextPart, resample
from mstar_core.api.media.video import VideoPart
from mstar_core.api.realtime.conversation import TokensPart
from mstar_core.api.requests.adapters import ApiAdapter
from mstar_core.errors import RequestError
from mstar_core.sampling import sampling_names
from mstar_qwen_omni.audio_encoder import audio_token_count

SYSTEM = ("You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
          "auditory and visual inputs, as well as generating text and speech.")
_FORWARD = sampling_names("max_tokens", "temperature", "top_p", "top_k", "seed", "repetition_penalty", "grammar")


#: Prompt tokens kept free beside the audio: the chat template's turns and at least a short reply.
CONTEXT_RESERVE = 64


def audio_seconds_that_fit(cfg: Any, ceiling: float = 600.0) -> float:
    """The longest audio part whose encoder tokens (13 a second) still leave CONTEXT_RESERVE of the Thinker's context:
    the chat limit, so audio that can never fit is a 413 from its header, not after seconds of features."""
    per_second = audio_token_count(100, cfg.thinker.audio.n_window)  # 100 mel frames a second at hop 160, 16 kHz
    room = cfg.thinker.text.max_position_embeddings - CONTEXT_RESERVE
    return float(min(ceiling, max(1, room // per_second)))


def _part(part: Any) -> dict[str, Any]:
    """A decoded chat part -> the model's message part (audio resampled to the encoder's 16 kHz)."""
    if isinstance(part, TextPart):
        return {"type": "text", "text": part.text}
    if isinstance(part, AudioPart):
        return {"type": "audio", "audio": torch.from_numpy(resample(part.samples, part.sample_rate, 16000))}
    if isinstance(part, VideoPart):  # the audio track, when the request asked for it, follows as its own part
        return {"type": "video", "video": torch.from_numpy(part.frames), "fps": part.fps}
    if isinstance(part, TokensPart):
        return {"type": "tokens", "ids": list(part.ids)}
    if isinstance(part, ImagePart):
        return {"type": "image", "image": torch.from_numpy(np.asarray(part.image.convert("RGB"), dtype=np.uint8))}
    raise RequestError(f"unsupported chat part {type(part).__name__}")


def _parts(part: Any) -> list[dict[str, Any]]:
    out = [_part(part)]
    if isinstance(part, VideoPart) and part.audio is not None and part.audio.size:
        out.append({"type": "audio", "audio": torch.from_numpy(resample(part.audio, part.audio_rate, 16000))})
    return out


class QwenOmniAdapter(ApiAdapter):
    model = "qwen3-omni"
    routes = {"chat", "speech"}
    # the voices are the schema's `speaker` choices (the checkpoint's Talker speakers), checked when prepared
    request_fields = {"speech": {"voice": "speaker"}, "chat": {"voice": "speaker"}}
    sample_rate = 24000
    audio_output = "audio"
    chat_audio_output = "audio"
    token_output = "next_token"
    chat_media = frozenset({"image", "audio", "video"})
    #: realtime sessions pass earlier replies as their generated ids (`TokensPart`): turn 2 prefills only itself
    takes_token_parts = True

    def bind(self, loaded: Any) -> None:
        self.loaded = loaded
        self.tokenizer = loaded.extras["tokenizer"]
        cfg = loaded.extras["config"]
        self.media_limits = MediaLimits(max_audio_seconds=audio_seconds_that_fit(cfg))
        self.audio_tokens_per_second = float(audio_token_count(100, cfg.thinker.audio.n_window))
        self.context_tokens = int(cfg.thinker.text.max_position_embeddings)
        self.stop_id = cfg.im_end_token_id
        self.special = {cfg.im_start_token_id, cfg.im_end_token_id}
        if loaded.extras["model"].talker is None:
            self.chat_audio_output = None
            self.routes = {"chat"}

    def _extras(self, body: Mapping[str, Any]) -> dict[str, Any]:
        out = {k: body[k] for k in _FORWARD if body.get(k) is not None}
        if "max_tokens" in out:  # speech runs about 4 frames per text token; 8x bounds a Talker that never ends
            out["talker_max_tokens"] = min(4096, 8 * int(out["max_tokens"]) + 32)
        return out

    def speech_inputs(self, body: Mapping[str, Any]) -> dict[str, Any]:
        text = body.get("input")
        if not isinstance(text, str) or not text.strip():
            raise RequestError("'input' must be a non-empty string: the text to speak", param="input")
        voice = str(body.get("voice") or self.voices[0]).lower()
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Read this aloud exactly: {text}"}]
        budget = 2 * len(self.tokenizer.encode(text, add_special_tokens=False).ids) + 8
        return {"messages": messages, "speaker": voice, **self._extras({"max_tokens": budget, **body})}

    def chat_message_inputs(self, body: Mapping[str, Any], messages: list) -> dict[str, Any]:
        turns = [{"role": m.role if m.role in ("system", "user", "assistant") else "user",
                  "content": [q for p in m.parts for q in _parts(p)]} for m in messages]
        audio = body.get("audio")
        inputs = {"messages": turns, **self._extras(body)}
        if audio:
            inputs["speaker"] = str(audio["voice"]).lower()
        return inputs

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode([t for t in token_ids if t not in self.special], skip_special_tokens=True)

    def is_stop_token(self, token_id: int) -> bool:
        return token_id == self.stop_id
