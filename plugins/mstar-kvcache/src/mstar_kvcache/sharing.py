"""Pages shared across nodes: a node reading, read-only, the labels another node of its model wrote.

A node with the option `share_cache_with: 'vlm'` reads the labels node `vlm` wrote for the same
request (pi0.5's action expert attends to the VLM prefix layer by layer). The pool lives with the
owner, `vlm`'s engine: the runtime builds it first and hands it to the reader's engine
(`EngineContext.peers`), which adopts the owner's pool once their KV shapes agree, so the reader
holds plain page references into it and no KV is copied.
"""

from __future__ import annotations

from typing import Any

from mstar_core.errors import ModelLoadError

_SHAPE = ("layers", "kv_heads", "head_dim", "dtype")


def cache_owner(engine: Any, owner: str, shape: tuple[Any, ...]) -> Any:
    """The engine of node `owner`, whose pool `engine` (a reader of its labels, of KV shape `shape`) adopts."""
    partner = engine.context.peers.get(owner)
    name = engine.node.name
    if partner is None:
        raise ModelLoadError(f"node '{name}' (engine 'kvcache') shares the KV cache of node '{owner}', which is not "
                             "built in this process; place both nodes in the same process (or worker)")
    if partner.kv_shape != shape:
        diff = ", ".join(f"{n} {a} vs {b}" for n, a, b in zip(_SHAPE, shape, partner.kv_shape, strict=True) if a != b)
        raise ModelLoadError(f"node '{name}' (engine 'kvcache') shares the KV cache of node '{owner}', but their KV "
                             f"shapes differ ({diff}); only nodes with equal layer count, KV heads, head dim and "
                             "dtype can share pages")
    return partner
