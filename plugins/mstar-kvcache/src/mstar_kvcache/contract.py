"""What the `kvcache` engine calls on a node's module, and the check that runs when the engine is built."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from mstar_core.errors import ModuleContractError
from mstar_core.runtime.contract import check_method, protocol_call

#: Config fields the engine sizes the KV pool from (`head_dim` may come from hidden_size / num_attention_heads,
#: `num_key_value_heads` defaults to num_attention_heads).
CONFIG_FIELDS = ("num_hidden_layers", "num_key_value_heads", "head_dim", "vocab_size", "hidden_size")


class KVCacheConfig(Protocol):
    """The model's shape, HF style (an attrs/dataclass object or a mapping)."""

    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    hidden_size: int


class KVCacheModule(Protocol):
    """A transformer the kvcache engine runs: packed tokens of a whole batch in, hidden states out.

    `config` sizes the KV pool; a module may instead define
    `kv_cache_spec() -> (layers, kv_heads, head_dim, vocab_size, hidden_size or None)`.
    `embed` and `input_embeds` are needed only by nodes that take an `input_embeds` input.
    """

    config: KVCacheConfig

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        context: Any,
        /,
        *,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids `[T]` (None when `input_embeds` `[T, H]` is given) at `positions` -> hidden `[T, H]`."""
        ...

    def embed(self, ids: torch.Tensor, /) -> torch.Tensor:
        """Token embeddings `[T, H]`; the engine overwrites the rows of spliced-in embeddings."""
        ...

    def compute_logits(self, hidden: torch.Tensor, /) -> torch.Tensor:
        """Hidden `[N, H]` of the rows to sample -> logits `[N, vocab]`."""
        ...


class KVCacheSpec(Protocol):
    """The alternative to `config`: the KV pool's sizes straight from the module."""

    def kv_cache_spec(self) -> tuple[int, int, int, int, int | None]: ...


def _where(node: str) -> str:
    return f"node '{node}' (engine 'kvcache')"


def _check_shape(module: Any, node: str) -> None:
    """`kv_cache_spec()` returns five sizes, or `config` has the fields the pool is sized from."""
    spec = getattr(module, "kv_cache_spec", None)
    if spec is not None:
        check_method(module, "kv_cache_spec", protocol_call(KVCacheSpec, "kv_cache_spec"), node=node, engine="kvcache")
        value = spec()
        sizes = tuple(value) if isinstance(value, tuple | list) else ()
        if len(sizes) != 5 or not all(isinstance(v, int) and v > 0 for v in sizes[:4]):
            raise ModuleContractError(
                f"{_where(node)}: kv_cache_spec() returned {value!r:.80}; it must return "
                "(num_layers, num_kv_heads, head_dim, vocab_size, hidden_size or None) with positive ints",
                node=node, engine="kvcache", method="kv_cache_spec",
            )
        return
    cfg = getattr(module, "config", None)
    if cfg is None:
        raise ModuleContractError(
            f"{_where(node)}: module {type(module).__name__} has no `config` (with {', '.join(CONFIG_FIELDS)}) "
            "and no kv_cache_spec(); give it one of them",
            node=node, engine="kvcache", method="config",
        )
    get = cfg.get if isinstance(cfg, Mapping) else lambda k: getattr(cfg, k, None)
    missing = [k for k in ("num_hidden_layers", "vocab_size") if get(k) is None]
    heads = get("num_attention_heads")
    if get("head_dim") is None and (get("hidden_size") is None or heads is None):
        missing.append("head_dim (or hidden_size and num_attention_heads)")
    if get("num_key_value_heads") is None and heads is None:
        missing.append("num_key_value_heads (or num_attention_heads)")
    if missing:
        raise ModuleContractError(
            f"{_where(node)}: module {type(module).__name__}'s config lacks {', '.join(missing)}; the engine sizes "
            f"the KV pool from {', '.join(CONFIG_FIELDS)} (or define kv_cache_spec())",
            node=node, engine="kvcache", method="config",
        )


def check_kvcache_module(module: Any, node: Any) -> None:
    """Raise `ModuleContractError` unless `module` meets `KVCacheModule` for `node` (embeddings only if it takes them)."""
    embeds = "input_embeds" in node.all_inputs
    omit = () if embeds else ("input_embeds",)
    check_method(module, "forward", protocol_call(KVCacheModule, "forward", omit), node=node.name, engine="kvcache")
    check_method(module, "compute_logits", protocol_call(KVCacheModule, "compute_logits"),
                 node=node.name, engine="kvcache", why="it turns the sampled rows' hidden states into logits")
    if embeds:
        check_method(module, "embed", protocol_call(KVCacheModule, "embed"), node=node.name, engine="kvcache",
                     why="the node takes input 'input_embeds', spliced over the token embeddings")
    _check_shape(module, node.name)
