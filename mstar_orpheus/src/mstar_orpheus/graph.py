"""Orpheus as a Walk Graph: the `lm` (paged KV) streams audio tokens into `snac` (stateless) while decoding."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mstar_core.graph import DynamicLoop, Graph, GraphNode, NodeCall, StreamingGraphEdge, Walk
from mstar_core.streaming import SlidingWindowChunkPolicy
from mstar_orpheus.codes import STRIDE_TOKENS, WINDOW_TOKENS, AudioTokenMap


def _finished(env: Mapping[str, Any]) -> bool:
    # the engine sets finish_reason on end-of-speech (a stop token) or at max_tokens
    return env.get("finish_reason") is not None


def build_graph(
    lm: Any,
    snac: Any,
    audio: AudioTokenMap,
    *,
    lm_engine: str = "kvcache",
    snac_engine: str = "stateless",
) -> Graph:
    """Nodes `lm` and `snac`; walks `prefill` (prompt minus its last id) and `decode` (streams audio)."""
    nodes = [
        GraphNode(
            "lm",
            inputs=("input_ids",),
            optional_inputs=("sampling",),
            outputs=("next_token", "finish_reason", "logprob"),
            engine=lm_engine,
            module=lambda: lm,
        ),
        GraphNode(
            "snac",
            inputs=("codes",),
            optional_inputs=("noise_seed",),
            outputs=("audio",),
            engine=snac_engine,
            module=lambda: snac,
        ),
    ]
    prefill = Walk(
        name="prefill",
        body=NodeCall(
            "lm",
            inputs={"input_ids": "prompt_ids"},
            # prefill's sample is not part of the speech: decode re-feeds the prompt's last id
            outputs={"next_token": "prefill_token", "finish_reason": "prefill_finish", "logprob": "prefill_logprob"},
        ),
        inputs=("prompt_ids", "sampling"),
        description="prefill the prompt (all but start-of-speech) into the paged KV cache",
    )
    decode = Walk(
        name="decode",
        body=DynamicLoop(
            body=NodeCall("lm", inputs={"input_ids": "decode_ids"}),
            until=_finished,
            max_iters="max_tokens",
            carry={"next_token": "decode_ids"},
        ),
        inputs=("decode_ids", "sampling", "max_tokens"),
        optional_inputs=("noise_seed",),
        outputs=("audio",),
        emit=("audio", "next_token"),
        streams=(
            StreamingGraphEdge(
                "lm.next_token",
                "snac.codes",
                SlidingWindowChunkPolicy(window=WINDOW_TOKENS, stride=STRIDE_TOKENS),
                keep=audio.is_audio,
            ),
        ),
        description="generate audio tokens until end-of-speech; every 7 audio tokens SNAC decodes the last 28",
    )
    return Graph.build("orpheus", nodes, [prefill, decode], plan=lambda inputs: ["prefill", "decode"])
