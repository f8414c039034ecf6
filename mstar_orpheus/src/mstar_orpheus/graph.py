"""Orpheus as a Walk Graph: the `lm` (paged KV) streams audio tokens into `snac` (stateless) while decoding."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mstar_core.graph import (
    DynamicLoop,
    Graph,
    GraphNode,
    NodeCall,
    StreamingGraphEdge,
    Walk,
    stream_priority,
)
from mstar_core.streaming import SlidingWindowChunkPolicy
from mstar_orpheus.codes import STRIDE_TOKENS, WINDOW_TOKENS, AudioTokenMap

#: Seconds of queued audio a waiting stream counts as having (`stream_priority(start_lead=...)`): with 0, under
#: overload every arrival started at once and all ran dry (c=32 viability 0.0 in 3 of 3 rounds, BENCHMARKS).
START_LEAD = 2.0


def _finished(env: Mapping[str, Any]) -> bool:
    # the engine sets finish_reason on end-of-speech (a stop token) or at max_tokens
    return env.get("finish_reason") is not None


def _seconds_per_window(snac: Any) -> float:
    # each window emits one SNAC frame (4 hops: 2048 samples at 24 kHz, 85 ms)
    cut = getattr(snac, "slice", slice(0, 2048))
    config = getattr(getattr(snac, "snac", None), "config", None)
    return (cut.stop - cut.start) / float(getattr(config, "sampling_rate", 24000))


def build_graph(
    lm: Any,
    snac: Any,
    audio: AudioTokenMap,
    *,
    lm_engine: str = "kvcache",
    snac_engine: str = "stateless",
    priority: bool = True,
    start_lead: float = START_LEAD,
) -> Graph:
    """Nodes `lm` and `snac`; walks `prefill` (prompt minus its last id) and `decode` (streams audio).

    With `priority`, each decode step of the LM is ranked by how close the request's listener is to
    running out of audio (the seconds of audio its SNAC windows have released, minus the time since
    the first one): a stream about to stall is decoded ahead of one with audio to spare. A stream
    that has not started yet counts as `start_lead` seconds ahead less the time it has waited (see
    `stream_priority`): it starts once the playing ones are that far ahead, or after that long.
    """
    nodes = [
        GraphNode(
            "lm",
            inputs=("input_ids",),
            optional_inputs=("sampling", "lora"),  # lora: a LoRA adapter named as the request's model
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
        optional_inputs=("lora",),
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
        optional_inputs=("noise_seed", "lora"),
        outputs=("audio",),
        emit=("audio", "next_token"),
        streams=(
            StreamingGraphEdge(
                "lm.next_token",
                "snac.codes",
                SlidingWindowChunkPolicy(window=WINDOW_TOKENS, stride=STRIDE_TOKENS),
                keep=audio.is_audio,
                priority=stream_priority(per_chunk=_seconds_per_window(snac), start_lead=start_lead) if priority else None,
            ),
        ),
        description="generate audio tokens until end-of-speech; every 7 audio tokens SNAC decodes the last 28",
    )
    return Graph.build("orpheus", nodes, [prefill, decode], plan=lambda inputs: ["prefill", "decode"])
