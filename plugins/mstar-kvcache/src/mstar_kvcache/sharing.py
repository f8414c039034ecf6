"""Pages shared across nodes: engines of one model in one process whose nodes share a KV pool.

A node with the option `share_cache_with: 'vlm'` reads, read-only, the labels node `vlm` wrote for
the same request (pi0.5's action expert attends to the VLM prefix layer by layer). Both engines
then use one `PagePool`, so a reader holds plain page references into it and no KV is copied.

The runtime builds engines one node at a time and gives each only its node, so the engines find
each other here: a registry keyed by (model, worker, device, owner node) inside this plugin. The
first engine of the group to be built creates the pool, the others adopt it once their KV shape
(layers, KV heads, head dim, dtype) is checked against it. (The runtime could instead build one
pool per group and hand it to each engine; then this registry goes away.)
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from mstar_core.errors import ModelLoadError
from mstar_kvcache.pool import PagePool


class CacheGroup:
    """One pool and the engines (by node name) that share it."""

    def __init__(self, pool: PagePool, shape: tuple[Any, ...], owner_node: str):
        self.pool = pool
        self.shape = shape
        self.owner_node = owner_node
        self.engines: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


_GROUPS: weakref.WeakValueDictionary[tuple[Any, ...], CacheGroup] = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


def join_group(engine: Any, owner: str, shape: tuple[Any, ...], make_pool: Any) -> CacheGroup:
    """The group of `owner`'s pool for `engine` (created with `make_pool()` if this is the first member)."""
    node = engine.node
    key = (node.graph, engine.context.worker, str(engine.device), owner)
    with _LOCK:
        group = _GROUPS.get(key)
        if group is None:
            group = CacheGroup(make_pool(), shape, owner)
            _GROUPS[key] = group
        elif group.shape != shape:
            names = ("layers", "kv_heads", "head_dim", "dtype")
            diff = ", ".join(f"{n} {a} vs {b}" for n, a, b in zip(names, shape, group.shape, strict=True) if a != b)
            raise ModelLoadError(
                f"node '{node.name}' (engine 'kvcache') shares the KV cache of node '{owner}', but their KV shapes "
                f"differ ({diff}); only nodes with equal layer count, KV heads, head dim and dtype can share pages"
            )
        if node.name in group.engines and group.engines[node.name] is not engine:
            # the same model loaded again in this process: this load gets a group of its own
            group = CacheGroup(make_pool(), shape, owner)
            _GROUPS[key] = group
        group.engines[node.name] = engine
        return group
