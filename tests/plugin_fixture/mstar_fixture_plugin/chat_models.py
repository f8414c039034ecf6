"""Chat fixture models for the multimodal chat surface: exact, cheap outputs a test can predict.

- `fixture-talker` echoes the last user message byte by byte (token id = byte, 256 ends the reply) and, when the
  request asks for audio, speaks while it writes: a streaming edge hands each token to `voice`, which emits
  `SAMPLES_PER_TOKEN` samples of `AMPLITUDE * token / 255 * sin(2 pi f n / SAMPLE_RATE)`, n counting samples
  from the reply's start and f the voice's pitch. Text-only requests take a walk without `voice` (a plan).
- `fixture-narrator` is the same graph whose adapter reads the transcript from its own output `spoken`
  (each token's text upper-cased), not from the tokens.
- `fixture-media` takes images and audio in chat and answers with what reached it, in order, one item per part:
  `text(<chars>)`, `image(<H>x<W>x3 sum=<pixel sum>)`, `audio(<samples>@<rate> sum=<sum of samples * 32768>)`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from mstar_core.api.adapters import ApiAdapter
from mstar_core.api.media import AudioPart, ImagePart, MediaLimits, TextPart
from mstar_core.errors import RequestError
from mstar_core.graph import DynamicLoop, Graph, GraphNode, NodeCall, StreamingGraphEdge, Walk
from mstar_core.model import LoadedModel, ModelSpec
from mstar_core.streaming import FixedChunkPolicy

EOS = 256
SAMPLE_RATE = 16000
SAMPLES_PER_TOKEN = 160
AMPLITUDE = 0.5
VOICES = {"alto": 440.0, "bass": 110.0}
STEP_DELAY_S = 0.002  # per token: lets a streamed reply interleave text and audio as a real model's does


def _lm(loop_index: int, reply: list[int], max_tokens: int) -> dict[str, Any]:
    time.sleep(STEP_DELAY_S)
    token = reply[loop_index]
    reason = "stop" if token == EOS else ("length" if loop_index + 1 >= max_tokens else None)
    return {"next_token": token, "finish_reason": reason}


def _voice(tokens: Any, pitch: float) -> dict[str, Any]:
    (token,) = tokens.new_items
    n = np.arange(SAMPLES_PER_TOKEN) + tokens.start * SAMPLES_PER_TOKEN
    wave = AMPLITUDE * (token / 255.0) * np.sin(2 * math.pi * pitch * n / SAMPLE_RATE)
    return {"audio": torch.from_numpy(wave.astype(np.float32)), "spoken": bytes([token]).decode("latin-1").upper()}


def _build_graph(name: str) -> Graph:
    def loop() -> DynamicLoop:
        return DynamicLoop(body=NodeCall("lm"), until=lambda env: env["finish_reason"] is not None,
                           max_iters="max_tokens")

    nodes = [
        GraphNode("lm", inputs=("loop_index", "reply", "max_tokens"), outputs=("next_token", "finish_reason"),
                  engine="function", module=lambda: _lm),
        GraphNode("voice", inputs=("tokens", "pitch"), outputs=("audio", "spoken"), engine="function",
                  module=lambda: _voice),
    ]
    walks = [
        Walk(name="write", body=loop(), inputs=("reply", "max_tokens"), outputs=("finish_reason",),
             emit=("next_token",), description="echo the last user message"),
        Walk(name="speak", body=loop(), inputs=("reply", "max_tokens", "pitch"), outputs=("finish_reason",),
             emit=("next_token", "audio", "spoken"),
             streams=(StreamingGraphEdge("lm.next_token", "voice.tokens", FixedChunkPolicy(1),
                                         keep=lambda token: token != EOS),),
             description="echo it and speak each token as it is written"),
    ]
    return Graph.build(name, nodes, walks, plan=lambda env: ["speak"] if env.get("pitch") is not None else ["write"])


def _reply(text: str, max_tokens: Any) -> dict[str, Any]:
    return {"reply": list(text.encode("utf-8")) + [EOS], "max_tokens": int(max_tokens or 256)}


def _talker_prepare(inputs: Mapping[str, Any]) -> dict[str, Any]:
    text = inputs.get("text")
    if not isinstance(text, str):
        raise RequestError("'text' must be a string", param="text")
    env = _reply(text, inputs.get("max_tokens"))
    voice = inputs.get("voice")
    if voice is not None:
        if voice not in VOICES:
            raise RequestError(f"voice must be one of {sorted(VOICES)}", param="voice")
        env["pitch"] = VOICES[voice]
    return env


def _describe(items: list[tuple[str, Any]]) -> str:
    out = []
    for kind, value in items:
        if kind == "text":
            out.append(f"text({len(value)})")
        elif kind == "image":
            h, w, c = value.shape
            out.append(f"image({h}x{w}x{c} sum={int(value.to(torch.int64).sum())})")
        else:
            samples, rate = value
            out.append(f"audio({samples.numel()}@{rate} sum={round(float(samples.double().sum()) * 32768)})")
    return " ".join(out)


def _media_prepare(inputs: Mapping[str, Any]) -> dict[str, Any]:
    return _reply(_describe(inputs["items"]), inputs.get("max_tokens"))


def _load(name: str, prepare: Any) -> LoadedModel:
    return LoadedModel(name=name, graph=_build_graph(name), random_weights=True, prepare=prepare)


class _ByteText(ApiAdapter):
    routes = {"chat"}

    def detokenize(self, token_ids):
        return bytes(int(t) for t in token_ids if int(t) < 256).decode("utf-8", errors="replace")

    def is_stop_token(self, token_id):
        return int(token_id) == EOS


class TalkerAdapter(_ByteText):
    """Speaks in chat: audio on `audio`, the transcript is the reply's text."""

    model = "fixture-talker"
    voices = sorted(VOICES)
    sample_rate = SAMPLE_RATE
    chat_audio_output = "audio"

    def chat_message_inputs(self, body, messages):
        last = next((m.text for m in reversed(messages) if m.role == "user"), "")
        audio = body.get("audio")
        return {"text": last, "max_tokens": body.get("max_tokens"), "voice": audio["voice"] if audio else None}


class NarratorAdapter(TalkerAdapter):
    """The talker whose transcript comes from its own output (`spoken`)."""

    model = "fixture-narrator"
    chat_transcript_output = "spoken"


class MediaAdapter(_ByteText):
    """Takes images and audio; small limits so the tests can exceed them cheaply."""

    model = "fixture-media"
    chat_media = frozenset({"image", "audio"})
    media_limits = MediaLimits(max_image_pixels=64 * 64, max_image_bytes=64 * 1024, max_audio_seconds=2.0,
                               max_audio_bytes=256 * 1024)

    def chat_message_inputs(self, body, messages):
        items: list[tuple[str, Any]] = []
        for message in messages:
            for part in message.parts:
                if isinstance(part, TextPart):
                    items.append(("text", part.text))
                elif isinstance(part, ImagePart):
                    items.append(("image", part.tensor()))
                elif isinstance(part, AudioPart):
                    items.append(("audio", (part.tensor(), part.sample_rate)))
        return {"items": items, "max_tokens": body.get("max_tokens")}


TALKER = ModelSpec(name="fixture-talker", load=lambda options: _load("fixture-talker", _talker_prepare),
                   description="echoes text, speaks it as a deterministic tone (chat audio tests)")
NARRATOR = ModelSpec(name="fixture-narrator", load=lambda options: _load("fixture-narrator", _talker_prepare),
                     description="fixture-talker with a transcript output of its own (chat audio tests)")
MEDIA = ModelSpec(name="fixture-media", load=lambda options: _load("fixture-media", _media_prepare),
                  description="answers with the shapes of the images and audio it got (chat media tests)")
ADAPTERS = (TalkerAdapter, NarratorAdapter, MediaAdapter)
