"""The standard autoregressive walks (`prefill`, then `decode` until a finish reason) for a `kvcache` node."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from mstar_core.graph import DynamicLoop, NodeCall, Walk
from mstar_core.sampling import SamplingParams

#: what a request that names no `max_tokens` gets: SamplingParams' own default, declared once in mstar_core.sampling
_DEFAULT_MAX_TOKENS = attrs.fields(SamplingParams).max_tokens.default


def decode_iterations(sampling: str = "sampling", default_max_tokens: int | None = None):
    """`max_iters` for the decode loop: the tokens still allowed after prefill sampled the first one.

    `default_max_tokens` (None: SamplingParams' default) applies when the env carries no sampling fields."""
    default_max_tokens = _DEFAULT_MAX_TOKENS if default_max_tokens is None else default_max_tokens

    def max_iters(env: Mapping[str, Any]) -> int:
        if env.get("finish_reason") is not None:
            return 0  # prefill already stopped (stop token, or max_tokens == 1)
        params = env.get(sampling)
        if isinstance(params, SamplingParams):
            limit = params.max_tokens
        elif isinstance(params, Mapping) and "max_tokens" in params:
            limit = int(params["max_tokens"])
        else:
            limit = default_max_tokens
        return max(limit - 1, 0)

    return max_iters


#: The env name (and node input) of the LoRA adapter a request runs under: a node that declares it as an optional
#: input takes it in these walks (the runtime sets it when a request names an adapter as its model)
LORA_INPUT = "lora"


def _finished(env: Mapping[str, Any]) -> bool:
    return env.get("finish_reason") is not None


def ar_walks(
    node: str = "lm",
    *,
    prompt: str = "input_ids",
    token: str = "next_token",
    sampling: str = "sampling",
    cache_label: str | None = None,
    default_max_tokens: int | None = None,
    prefill_name: str = "prefill",
    decode_name: str = "decode",
) -> tuple[Walk, Walk]:
    """`prefill` runs the prompt (env `prompt`) and samples a first token; `decode` feeds each token back.

    Both emit `token` as it is produced and leave `finish_reason` in the env. The node must be a
    `kvcache` node with input `input_ids` and outputs `next_token`, `finish_reason`; one that also declares the
    optional input `lora` runs under the request's LoRA adapter, when it names one.
    """
    options = {} if cache_label is None else {"cache_label": cache_label}
    outputs = {"next_token": token}
    prefill = Walk(
        name=prefill_name,
        body=NodeCall(node, inputs={"input_ids": prompt, "sampling": sampling}, outputs=outputs, options=options),
        inputs=(prompt,),
        optional_inputs=(sampling, LORA_INPUT),
        outputs=(token, "finish_reason"),
        emit=(token,),
        description=f"run the prompt through '{node}' and sample the first token",
    )
    decode = Walk(
        name=decode_name,
        body=DynamicLoop(
            body=NodeCall(node, inputs={"input_ids": token, "sampling": sampling}, outputs=outputs, options=options),
            until=_finished,
            max_iters=decode_iterations(sampling, default_max_tokens),
        ),
        inputs=(token,),
        optional_inputs=(sampling, LORA_INPUT),
        outputs=(token, "finish_reason"),
        emit=(token,),
        description=f"feed each sampled token back into '{node}' until a finish reason",
    )
    return prefill, decode
