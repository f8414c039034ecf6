"""Drive a `kvcache` engine the way the runtime does: prefill, then feed each token back until done."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from mstar_kvcache import KVCacheEngine

from mstar_core.graph import GraphNode
from mstar_core.runtime.engine import EngineContext, Invocation

LM_NODE = GraphNode(
    "lm",
    inputs=("input_ids",),
    outputs=("next_token", "finish_reason", "logits"),
    engine="kvcache",
    optional_inputs=("sampling", "input_embeds"),
)


def make_engine(model: Any, **settings: Any) -> KVCacheEngine:
    return KVCacheEngine(LM_NODE, model, EngineContext("test", torch.device("cpu"), settings))


def generate(
    engine: KVCacheEngine,
    prompts: Mapping[str, Sequence[int]],
    steps: int,
    inputs: Mapping[str, Mapping[str, Any]] | None = None,
    on_step: Callable[[KVCacheEngine], None] | None = None,
    release: bool = True,
) -> dict[str, list[int]]:
    """Greedy-by-default continuation of each prompt for `steps` tokens (or until a finish reason)."""
    extra = inputs or {}
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():
        engine.add(Invocation(rid, "lm", {"input_ids": list(prompt), **extra.get(rid, {})}, {}))
    while engine.has_work():
        for inv, res in engine.step():
            if isinstance(res, BaseException):
                raise res
            out[inv.request_id].append(res["next_token"])
            if len(out[inv.request_id]) < steps and res["finish_reason"] is None:
                engine.add(Invocation(inv.request_id, "lm", {"input_ids": res["next_token"], **extra.get(inv.request_id, {})}, {}))
            elif release:
                engine.release(inv.request_id)
        if on_step is not None:
            on_step(engine)
    return out
