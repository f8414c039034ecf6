"""Whisper as a Walk Graph: the encoder on the stateless engine, the decoder on the paged kvcache engine.

```
encode:   encoder(log-mel [n_mels, 3000]) -> encoder_states [1500, d]
detect:   decoder([SOT], cross_states) on label 'detect' (dropped after): the encoder states become the request's
          cross label 'audio' (per-layer K/V in pool pages), the language is the likeliest language token, and
          P(<|nospeech|>) is read at SOT
prefill:  prompt -> [<|startofprev|> prev..., SOT, language, task, <|notimestamps|>?]
          decoder(prompt) on label 'main', cross-attending 'audio' -> first token
decode:   loop: decoder(token) until end-of-text or max_tokens
          (with word timestamps: the loop keeps its tokens, then align(encoder states, the window's text) -> per-token
          times from the alignment heads' cross-attention, see alignment.py)
longform: loop over 30-second windows of the whole clip's log-mel, from seek 0 until the clip's end:
            window(mel, seek) -> encoder -> decoder(prompt, new cross states; label 'main' reset)
            -> loop decoder(token) -> align (when word timestamps are asked) -> seek: the window's segments, the
            next seek (after its last timestamp pair)
```

A short request runs `encode, detect, prefill, decode` (`decode_words` in place of `decode` for word timestamps); a long one (over 30 s) `encode, detect, longform`, its first
window's features serving the language detection.

Whisper's rules (suppressed tokens, timestamp pairs, language detection) are the decoder module's
`process_logits`, which the kvcache sampler applies from each row's tokens; nothing here keeps a cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mstar_kvcache.walks import decode_iterations

from mstar_core.graph import Copy, DynamicLoop, Graph, GraphNode, NodeCall, Sequential, Walk
from mstar_whisper.alignment import WordAligner
from mstar_whisper.config import WhisperTokens
from mstar_whisper.longform import SeekNext, WindowFeatures

#: The request's cross-attention label on the decoder: the encoder output of its (current) 30-second window.
AUDIO = "audio"
WALKS = ("encode", "detect", "prefill", "decode")
LONG_WALKS = ("encode", "detect", "longform")
WORD_WALKS = ("encode", "detect", "prefill", "decode_words")
#: what the alignment nodes read (the window's tokens arrive as `first_token` and the loop's `window_tokens`)
ALIGN_INPUTS = ("encoder_states", "first_token", "window_tokens", "detected_language", "language_token", "task_token",
                "content_frames", "word_timestamps")


def _plan(env: Mapping[str, Any]) -> list[str]:
    if env.get("long_form"):
        return list(LONG_WALKS)
    return list(WORD_WALKS if env.get("word_timestamps") else WALKS)


def _clip_done(env: Mapping[str, Any]) -> bool:
    return env["seek"] >= env["max_frames"]


def _max_windows(env: Mapping[str, Any]) -> int:
    # a window advances by at least one timestamp (2 frames) unless it ends the clip: a bound, not an estimate
    return env["max_frames"] // 2 + 1


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
        GraphNode("window", inputs=("mel", "seek", "max_frames"), outputs=("input_features", "seek_frames", "time_offset"),
                  engine="function", module=lambda: WindowFeatures()),
        GraphNode("seek", inputs=("first_token", "window_tokens", "seek", "seek_frames", "time_offset"),
                  outputs=("next_seek", "window_result"), engine="function",
                  module=lambda: SeekNext(tokens.timestamp_begin, tokens.eot)),
        GraphNode("align", inputs=ALIGN_INPUTS, outputs=("token_times",), engine="function",
                  module=lambda: WordAligner(decoder, tokens, long_form=False)),
        GraphNode("align_window", inputs=ALIGN_INPUTS, outputs=("token_times",), engine="function",
                  module=lambda: WordAligner(decoder, tokens, long_form=True)),
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
    step = NodeCall("decoder", inputs={"input_ids": "next_token", "sampling": "sampling"},
                    outputs={"next_token": "next_token", "finish_reason": "finish_reason", "logprob": "logprob"})
    decode_words = Walk(
        name="decode_words",
        inputs=("next_token", "encoder_states", "detected_language", "language_token", "task_token", "content_frames",
                "word_timestamps"),
        optional_inputs=("sampling",), outputs=("next_token", "finish_reason", "token_times"),
        emit=("next_token", "logprob"),
        body=Sequential(
            Copy(first_token="next_token"),
            DynamicLoop(body=step, until=_finished, max_iters=decode_iterations("sampling"),
                        accumulate={"next_token": "window_tokens"}),
            NodeCall("align"),
        ),
        description="decode as `decode` does, keeping the tokens; then each text token's times from the alignment "
                    "heads' cross-attention (word timestamps)",
    )
    longform = Walk(
        name="longform",
        inputs=("mel", "max_frames", "seek", "detected_language", "language_token", "task_token", "timestamps",
                "prev_ids", "word_timestamps"),
        optional_inputs=("sampling",), outputs=("windows", "window_token_times"), emit=("next_token", "logprob"),
        body=DynamicLoop(
            body=Sequential(
                NodeCall("window"),
                NodeCall("encoder"),
                NodeCall("prompt"),
                NodeCall("decoder", inputs={"input_ids": "prompt_ids", "cross_states": "encoder_states",
                                            "sampling": "sampling"},
                         outputs={"next_token": "next_token", "finish_reason": "finish_reason", "logprob": "logprob"},
                         options={"cross_label": AUDIO, "reset": True}),
                Copy(first_token="next_token", replace=True),
                DynamicLoop(body=step, until=_finished, max_iters=decode_iterations("sampling"),
                            accumulate={"next_token": "window_tokens"}, index_name="token_index"),
                NodeCall("align_window", inputs={"content_frames": "seek_frames"}),
                NodeCall("seek"),
            ),
            until=_clip_done, max_iters=_max_windows, carry={"next_seek": "seek"},
            accumulate={"window_result": "windows", "token_times": "window_token_times"}, index_name="window_index",
        ),
        description="Whisper's sequential long-form: 30-second windows, each seeking after the last timestamp pair",
    )
    return Graph.build(name, nodes, [encode, detect, prefill, decode, decode_words, longform], plan=_plan)
