"""Qwen3-TTS as a Walk Graph: the Talker, its code predictor and the speech decoder, streaming.

```
speak:  talker_prompt -> talker (prefill) -> code 0
        loop until the Talker's finish reason:
          frame_seed -> code_predictor(label 'frame', reset, decode_steps G - 1)
          frame_step -> frame codes, next step rows (codec embeddings + text row)
          talker(step rows) -> code 0, hidden
        |-- frame_step.codes (LeftContextChunkPolicy(25, 25)) --> code2wav -> audio
```

The same walk serves a preset speaker (CustomVoice: the speaker's codec embedding in the prefix), a cloned voice
(Base: its cached x-vector in that slot, and with a transcript its cached reference codes in context) and voice design (the instruction's projected turn first, no speaker
slot); the request's prepared inputs choose. A frame's G - 1
code-predictor steps are one call on a scratch label the kvcache engine resets per frame, feeding each sampled code
back itself. The speech decoder decodes each 25-frame window (with 25 frames of context) as soon as it exists,
exactly as Qwen3-Omni's Code2Wav does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mstar_core.graph import (
    DynamicLoop,
    Graph,
    GraphNode,
    NodeCall,
    Sequential,
    StreamingGraphEdge,
    Walk,
    stream_priority,
)
from mstar_core.nn.code_predictor import FrameSeed
from mstar_core.streaming import LeftContextChunkPolicy
from mstar_qwen_tts.checkpoint import QwenTTS
from mstar_qwen_tts.nodes import FrameStep, TalkerPrompt
from mstar_qwen_tts.speech_decoder import ClonedWindowDecoder, SpeechDecoder

CHUNK_FRAMES, LEFT_FRAMES = 25, 25
SAMPLE_RATE = 24000
#: Seconds of audio a stream not yet started counts as having (`stream_priority(start_lead=...)`), as Orpheus's: a new
#: request starts once the playing ones are that far ahead of their listeners, or after waiting that long.
START_LEAD = 2.0
PROMPT_INPUTS = ("text_ids", "instruct_ids", "speaker", "language", "non_streaming")
#: A cloned voice (Base checkpoints): its x-vector and, when it was created with a transcript, the transcript's tokens
#: and the reference audio's codes (the in-context prompt)
CLONE_INPUTS = ("speaker_embedding", "ref_ids", "ref_codes")


def _talker_done(env: Mapping[str, Any]) -> bool:
    return env.get("talker_finish") is not None


def _frames_left(env: Mapping[str, Any]) -> int:
    # the prefill sampled the first code 0; it may already have ended the speech
    return 0 if env.get("talker_finish") is not None else int(env["talker_max_tokens"]) - 1


def build_graph(model: QwenTTS, decoder: SpeechDecoder, name: str = "qwen3-tts", *, priority: bool = True,
                start_lead: float = START_LEAD) -> Graph:
    """With `priority`, every call of the frame loop (the Talker, the code predictor, the frame's own nodes) is
    ranked by how close the request's listener is to running out of audio (see `stream_priority`)."""
    talker, cfg = model.talker, model.config
    groups = cfg.talker.num_code_groups
    talker_outputs = {"next_token": "code0", "hidden": "talker_hidden", "finish_reason": "talker_finish"}
    nodes = [
        GraphNode("talker", inputs=("input_embeds",), optional_inputs=("input_ids", "sampling"),
                  outputs=("next_token", "finish_reason", "hidden"), engine="kvcache", module=lambda: talker),
        GraphNode("code_predictor", inputs=(), optional_inputs=("input_ids", "input_embeds", "sampling"),
                  outputs=("next_token",), engine="kvcache", module=lambda: talker.code_predictor),
        GraphNode("talker_prompt", inputs=PROMPT_INPUTS, optional_inputs=CLONE_INPUTS,
                  outputs=("talker_in", "talker_ids", "trailing", "text_step"),
                  engine="function", module=lambda: TalkerPrompt(talker, cfg)),
        GraphNode("frame_seed", inputs=("hidden", "code0"), outputs=("cp_seed",), engine="function",
                  module=lambda: FrameSeed(talker)),
        GraphNode("frame_step", inputs=("code0", "cp_codes", "trailing", "text_step", "talker_finish",
                                         "talker_sampling", "talker_opening_sampling"),
                  outputs=("codes", "step_embeds", "text_step", "step_sampling"), engine="function",
                  module=lambda: FrameStep(talker)),
        # a voice cloned in context: its reference codes are the first windows' left context
        GraphNode("code2wav", inputs=("codes",), optional_inputs=("ref_codes",), outputs=("audio",),
                  engine="stateless", module=lambda: ClonedWindowDecoder(decoder, LEFT_FRAMES)),
    ]
    frame = Sequential(
        NodeCall("frame_seed", inputs={"hidden": "talker_hidden"}),
        # codes 1..G-1 in one call on a scratch label: the engine feeds each sampled code back as the next input
        NodeCall("code_predictor", inputs={"input_embeds": "cp_seed", "input_ids": None,
                                           "sampling": "predictor_sampling"},
                 outputs={"next_token": "cp_codes"},
                 options={"cache_label": "frame", "reset": True, "decode_steps": groups - 1}),
        NodeCall("frame_step", outputs={"step_embeds": "talker_in"}),
        # input_ids: the code 0 this step's rows carry, so the repetition penalty sees the codes spoken
        NodeCall("talker", inputs={"input_embeds": "talker_in", "input_ids": "code0", "sampling": "step_sampling"},
                 outputs=talker_outputs),
    )
    speak = Walk(
        name="speak",
        body=Sequential(
            NodeCall("talker_prompt"),
            # the first two codes 0 are never EOS (upstream `min_new_tokens` 2): this one and the next step's
            NodeCall("talker", inputs={"input_embeds": "talker_in", "input_ids": "talker_ids",
                                       "sampling": "talker_opening_sampling"}, outputs=talker_outputs),
            DynamicLoop(body=frame, until=_talker_done, max_iters=_frames_left),
        ),
        inputs=(*PROMPT_INPUTS, "talker_sampling", "talker_opening_sampling", "predictor_sampling",
                "talker_max_tokens"),
        optional_inputs=CLONE_INPUTS,
        outputs=("audio",),
        emit=("codes", "audio"),  # codes: each frame's G codes (None for the last code 0)
        streams=(
            StreamingGraphEdge("frame_step.codes", "code2wav.codes", LeftContextChunkPolicy(CHUNK_FRAMES, LEFT_FRAMES),
                               keep=lambda codes: codes is not None,
                               priority=stream_priority(per_chunk=CHUNK_FRAMES * decoder.samples_per_frame / SAMPLE_RATE,
                                                         start_lead=start_lead)
                               if priority else None,
                               fed_by=("talker", "code_predictor", "frame_seed")),
        ),
        description="the Talker speaks frame by frame (code 0, then the predictor's 15 codes); the speech decoder "
                    "turns each 25-frame window into audio while it goes on",
    )
    return Graph.build(name, nodes, [speak], plan=lambda env: ["speak"])
