"""Whisper as a Walk Graph: the encoder on the stateless engine, the decoder on the paged kvcache engine.

```
encode:   encoder(log-mel [n_mels, 3000]) -> encoder_states [1500, d]
detect:   decoder([SOT], cross_states) on label 'detect' (dropped after): the encoder states become the request's
          cross label 'audio' (per-layer K/V in pool pages), the language is the likeliest language token, and
          P(<|nospeech|>) is read at SOT
prefill:  prompt -> [<|startofprev|> prev..., SOT, language, task, <|notimestamps|>?]
          decoder(prompt) on label 'main', cross-attending 'audio' -> first token
decode:   loop: decoder(token) until end-of-text or max_tokens
```

Whisper's rules (suppressed tokens, timestamp pairs, language detection) are the decoder module's
`process_logits`, which the kvcache sampler applies from each row's tokens; nothing here keeps a cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mstar_kvcache.walks import decode_iterations

from mstar_core.graph import DynamicLoop, Graph, GraphNode, NodeCall, Sequential, Walk
from mstar_whisper.config import WhisperTokens

#: The request's cross-attention label on the decoder: the encoder output of its (current) 30-second window.
AUDIO = "audio"
WALKS = ("encode", "detect", "prefill", "decode")


def _finished(env: Mapping[str, Any]) -> bool:
    return env.get("finish_reason") is not None


class PromptTokens:
    """The decoder prompt from the request's choices and the detected language (a `function` node)."""

    def __init__(self, tokens: WhisperTokens):
        self.tokens = tokens

    def __call__(self, detected_language: int, language_token: int, task_token: int, timestamps: bool,
                 prev_ids: list[int]) -> list[int]:
        t = self.tokens
        language = detected_language if language_token < 0 else language_token
        prev = [t.prev_sot, *prev_ids] if prev_ids else []
        head = [t.sot] + ([language] if t.languages else []) + ([task_token] if task_token >= 0 else [])
        return [*prev, *head, *([] if timestamps else [t.no_timestamps])]


def build_graph(encoder: Any, decoder: Any, tokens: WhisperTokens, *, name: str = "whisper",
                encoder_engine: str = "stateless", decoder_engine: str = "kvcache") -> Graph:
    nodes = [
        GraphNode("encoder", inputs=("input_features",), outputs=("encoder_states",), engine=encoder_engine,
                  module=lambda: encoder),
        GraphNode("decoder", inputs=("input_ids",), optional_inputs=("sampling", "cross_states", "output_index"),
                  outputs=("next_token", "finish_reason", "logprob", "no_speech"), engine=decoder_engine,
                  module=lambda: decoder),
        GraphNode("prompt", inputs=("detected_language", "language_token", "task_token", "timestamps", "prev_ids"),
                  outputs=("prompt_ids",), engine="function", module=lambda: PromptTokens(tokens)),
    ]
    encode = Walk(name="encode", inputs=("input_features",), outputs=("encoder_states",),
                  body=NodeCall("encoder"), description="log-mel features of the 30-second window -> encoder states")
    detect = Walk(
        name="detect", inputs=("encoder_states", "sot_ids", "sot_row"),
        outputs=("detected_language", "no_speech"),
        body=NodeCall("decoder", inputs={"input_ids": "sot_ids", "cross_states": "encoder_states",
                                         "output_index": "sot_row"},
                      outputs={"next_token": "detected_language", "finish_reason": "detect_finish",
                               "logprob": "detect_logprob", "no_speech": "no_speech"},
                      options={"cache_label": "detect", "cross_label": AUDIO, "drop": ["detect"]}),
        description="store the encoder states as the request's cross label; detect the language; P(no speech)",
    )
    prefill = Walk(
        name="prefill", inputs=("detected_language", "language_token", "task_token", "timestamps", "prev_ids"),
        optional_inputs=("sampling",), outputs=("prompt_ids", "next_token", "finish_reason"),
        emit=("next_token", "logprob"),
        body=Sequential(
            NodeCall("prompt"),
            NodeCall("decoder", inputs={"input_ids": "prompt_ids", "sampling": "sampling"},
                     outputs={"next_token": "next_token", "finish_reason": "finish_reason", "logprob": "logprob"},
                     options={"cross_label": AUDIO}),
        ),
        description="the prompt (previous text, start, language, task, timestamps) cross-attending the audio",
    )
    decode = Walk(
        name="decode", inputs=("next_token",), optional_inputs=("sampling",), outputs=("next_token", "finish_reason"),
        emit=("next_token", "logprob"),
        body=DynamicLoop(
            body=NodeCall("decoder", inputs={"input_ids": "next_token", "sampling": "sampling"},
                          outputs={"next_token": "next_token", "finish_reason": "finish_reason",
                                   "logprob": "logprob"}),
            until=_finished,
            max_iters=decode_iterations("sampling"),
        ),
        description="feed each token back until end-of-text (Whisper's rules mask the logits)",
    )
    return Graph.build(name, nodes, [encode, detect, prefill, decode], plan=lambda env: list(WALKS))
