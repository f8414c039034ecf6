"""Qwen3-Omni as a Walk Graph: Thinker, Talker, code predictor and Code2Wav as concurrent partitions.

```
prefill:  thinker(prompt) -> first reply token
decode:   thinker loop until a finish reason                             (text-only requests: nothing else)
speak:    thinker loop until a finish reason
            |-- next_token stream (1 token a chunk) --> talker fragment:
            |     talker_prompt -> text_start
            |     loop until the Talker's finish reason:
            |       talker(step embeds) -> code 0, hidden
            |       frame_seed -> code_predictor(label 'frame', reset, decode_steps G - 1)
            |       frame_step -> frame codes, next step embeds (codec embeddings + text part)
            |-- frame_step.codes (LeftContextChunkPolicy(25, 25)) --> code2wav -> audio
```

The plan picks `["prefill", "decode"]` or `["prefill", "speak"]`, so text-only requests never touch the
Talker. A frame's G - 1 code-predictor steps are one call: the kvcache engine feeds each sampled code back
itself (`decode_steps`), batching the steps of every request's frame, with no walk round trip per code. The Talker's fragment starts with the walk and waits on the Thinker's stream, so it speaks
while the Thinker writes; Code2Wav decodes each window as soon as 25 new frames exist.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mstar_kvcache.walks import decode_iterations

from mstar_core.graph import (
    DynamicLoop,
    Graph,
    GraphNode,
    NodeCall,
    Sequential,
    StreamingGraphEdge,
    Walk,
)
from mstar_core.nn.code_predictor import FrameSeed
from mstar_core.streaming import FixedChunkPolicy, LeftContextChunkPolicy
from mstar_qwen_omni.checkpoint import QwenOmni
from mstar_qwen_omni.nodes import Code2WavWindow, FrameStep, PromptEncoder, TalkerPrompt, TextStart

CHUNK_FRAMES, LEFT_FRAMES = 25, 25


def _finished(env: Mapping[str, Any]) -> bool:
    return env.get("finish_reason") is not None


def _talker_done(env: Mapping[str, Any]) -> bool:
    return env.get("talker_finish") is not None


def plan(env: Mapping[str, Any]) -> list[str]:
    speaks = env.get("speaker") is not None
    # only a spoken reply needs the prompt rows' accept-layer states; asking for every row's outputs means
    # computing every row, so a text reply's media prefill leaves them out and reuses cached pages
    first = ("prefill_mm_speak" if speaks else "prefill_mm") if env.get("has_media") else "prefill"
    return [first, "speak"] if speaks else [first, "decode"]


#: The Thinker's ports only the media prefill binds (the other walks never have them: left out there).
_MM_PORTS = ("input_embeds", "embeds_at", "positions", "deepstack")


def _thinker(ids: str, options: Mapping[str, Any] | None = None, **ports: str) -> NodeCall:
    inputs = {"input_ids": ids, "sampling": "sampling", **ports}
    return NodeCall("thinker", inputs=inputs, options=options or {})


#: The nodes on the speaking side: they read the Thinker's token embeddings, never its other weights.
SPEECH_NODES = ("talker", "code_predictor", "talker_prompt", "text_start", "frame_seed", "frame_step", "code2wav")


def build_graph(model: QwenOmni, name: str = "qwen3-omni", text_embed: Any = None) -> Graph:
    """`text_embed`: the Thinker's token embeddings for the speaking side (default: the Thinker's own table)."""
    groups = model.config.talker.num_code_groups
    text_embed = text_embed if text_embed is not None else model.thinker.model.embed_tokens
    # a speaking model's Thinker also gives the Talker's accept-layer states, per token, to the media prefill
    accept = ("accept_hidden",) if model.talker is not None else ()
    nodes = [
        # lora: the LoRA adapter a request names as its model (the Thinker's decoder runs under it)
        GraphNode("thinker", inputs=("input_ids",), optional_inputs=("sampling", "lora", *_MM_PORTS),
                  outputs=("next_token", "finish_reason", *accept), engine="kvcache", module=lambda: model.thinker),
        GraphNode("encode", inputs=("prompt_ids",),
                  optional_inputs=("audio_features", "image_patches", "image_grid", "video_patches", "video_grid"),
                  outputs=("mm_rows", "mm_at", "mm_deepstack"), engine="function",
                  module=lambda: PromptEncoder(model)),
    ]
    walks = [
        Walk(name="prefill",
             body=_thinker("prompt_ids"),
             inputs=("prompt_ids",), optional_inputs=("sampling", "lora"), outputs=("next_token", "finish_reason"),
             emit=("next_token",), description="run the prompt through the Thinker and sample the first reply token"),
        _media_prefill("prefill_mm", None),
        Walk(name="decode",
             body=_thinker_loop(),
             inputs=("next_token",), optional_inputs=("sampling", "lora"), outputs=("next_token", "finish_reason"),
             emit=("next_token",), description="the Thinker writes until a finish reason (text only)"),
    ]
    if accept:  # every prompt row's accept-layer state comes back beside the sample (the Talker's prompt reads it)
        walks.append(_media_prefill("prefill_mm_speak", {"output_rows": "all"}))
    if model.talker is not None:
        nodes += [
            GraphNode("talker", inputs=("input_embeds",), optional_inputs=("input_ids", "sampling", "positions"),
                      outputs=("next_token", "finish_reason", "hidden"), engine="kvcache", module=lambda: model.talker),
            GraphNode("code_predictor", inputs=(), optional_inputs=("input_ids", "input_embeds", "sampling"),
                      outputs=("next_token",), engine="kvcache", module=lambda: model.talker.code_predictor),
            GraphNode("talker_prompt", inputs=("prompt_ids", "first_token", "speaker"),
                      optional_inputs=("accept_hidden", "image_grid"),
                      outputs=("talker_in", "talker_positions", "talker_ids"),
                      engine="function", module=lambda: TalkerPrompt(model, text_embed)),
            GraphNode("text_start", inputs=("text",), outputs=("feed",), engine="function", module=lambda: TextStart()),
            GraphNode("frame_seed", inputs=("hidden", "code0"), outputs=("cp_seed",), engine="function",
                      module=lambda: FrameSeed(model.talker)),
            GraphNode("frame_step", inputs=("code0", "cp_codes", "text", "feed", "talker_finish"),
                      outputs=("codes", "step_embeds", "feed"), engine="function", module=lambda: FrameStep(model, text_embed)),
            GraphNode("code2wav", inputs=("codes",), outputs=("audio",), engine="stateless",
                      module=lambda: Code2WavWindow(model)),
        ]
        walks.append(Walk(
            name="speak",
            body=_thinker_loop(),
            inputs=("next_token", "prompt_ids", "speaker", "talker_sampling", "predictor_sampling", "talker_max_tokens"),
            optional_inputs=("sampling", "lora", "accept_hidden", "image_grid"),
            outputs=("next_token", "finish_reason", "audio"),
            emit=("next_token", "codes", "audio"),  # codes: each frame's G codes (None for the last code 0)
            streams=(
                StreamingGraphEdge("thinker.next_token", policy=FixedChunkPolicy(1), into="reply_text",
                                   consumer=_talker_fragment(groups)),
                StreamingGraphEdge("frame_step.codes", "code2wav.codes", LeftContextChunkPolicy(CHUNK_FRAMES, LEFT_FRAMES),
                                   keep=lambda codes: codes is not None),
            ),
            description="the Thinker writes while the Talker speaks its tokens and Code2Wav decodes 25-frame windows",
        ))
    return Graph.build(name, nodes, walks, plan=plan)


def _media_prefill(name: str, options: Mapping[str, Any] | None) -> Walk:
    return Walk(
        name=name,
        body=Sequential(
            NodeCall("encode"),
            _thinker("prompt_ids", options, input_embeds="mm_rows", embeds_at="mm_at", positions="prompt_positions",
                     deepstack="mm_deepstack")),
        inputs=("prompt_ids", "prompt_positions"),
        optional_inputs=("sampling", "lora", "audio_features", "image_patches", "image_grid", "video_patches",
                         "video_grid"),
        outputs=("next_token", "finish_reason"), emit=("next_token",),
        description="encode the audio and images, splice them into the prompt (M-RoPE, deepstack), prefill"
                    + (" with every row's accept-layer state (a spoken reply)" if options else ""))


def _thinker_loop() -> DynamicLoop:
    return DynamicLoop(body=_thinker("next_token"), until=_finished, max_iters=decode_iterations("sampling"))


def _frames_left(env: Mapping[str, Any]) -> int:
    # the prefill sampled the first code 0; it may already have ended the speech
    return 0 if env.get("talker_finish") is not None else int(env["talker_max_tokens"]) - 1


def _talker_fragment(groups: int) -> Sequential:
    talker_outputs = {"next_token": "code0", "hidden": "talker_hidden", "finish_reason": "talker_finish"}
    frame = Sequential(
        NodeCall("frame_seed", inputs={"hidden": "talker_hidden"}),
        # codes 1..G-1 in one call on a scratch label: the engine feeds each sampled code back as the next input
        NodeCall("code_predictor", inputs={"input_embeds": "cp_seed", "input_ids": None,
                                           "sampling": "predictor_sampling"},
                 outputs={"next_token": "cp_codes"},
                 options={"cache_label": "frame", "reset": True, "decode_steps": groups - 1}),
        NodeCall("frame_step", inputs={"text": "reply_text"}, outputs={"step_embeds": "talker_in"}),
        # input_ids: the code 0 this step's embeddings carry, so the repetition penalty sees the codes spoken
        NodeCall("talker", inputs={"input_embeds": "talker_in", "input_ids": "code0", "sampling": "talker_sampling",
                                   "positions": None}, outputs=talker_outputs),
    )
    return Sequential(
        NodeCall("talker_prompt", inputs={"first_token": "next_token"}),
        # the prefill (with M-RoPE positions when the user turns hold images); decode continues after them.
        # It needs only the first reply token, so it runs while the Thinker decodes the second.
        NodeCall("talker", inputs={"input_embeds": "talker_in", "input_ids": "talker_ids",
                                   "sampling": "talker_sampling", "positions": "talker_positions"},
                 outputs=talker_outputs),
        NodeCall("text_start", inputs={"text": "reply_text"}),
        DynamicLoop(body=frame, until=_talker_done, max_iters=_frames_left),
    )
