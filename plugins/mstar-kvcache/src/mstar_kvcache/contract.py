"""What the `kvcache` engine calls on a node's module, and the check that runs when the engine is built."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from mstar_core.errors import ModuleContractError
from mstar_core.runtime.contract import check_method, keyword_call, protocol_call

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
    `kv_cache_spec() -> (layers, kv_heads, head_dim, vocab_size or None, hidden_size or None)`.
    `embed` and `input_embeds` are needed only by nodes that take an `input_embeds` input, and
    `compute_logits` only by nodes that sample (`next_token`) or return `logits`.

    Optional declarations: `position_axes` (int, default 1: `positions` is `[T]`; 3 for M-RoPE:
    `[3, T]`), `call_inputs` (`{name: "token" | "sequence"}`: further per-call tensors the node takes,
    passed to `forward` as keyword arguments: "token" ones concatenated over the step's rows `[T, ...]`,
    "sequence" ones stacked `[S, ...]` with `sequence_index` `[T]` giving each row's sequence; a
    sequence whose call lacks one gets zeros, so zeros must mean "absent" to the module, or its routing
    must ignore those rows; a tensor no call of the step has is not passed at all), and `compute_<name>(hidden) -> [N, ...]` for each
    output `<name>` the node declares beyond the built-in ones (velocities from hidden states). A
    node with input `routing` gets `routing=` `[T]` integer expert ids in `forward`. `forward_rows = True`:
    `forward` takes `rows=` `[N]` (indices into T) and returns those rows' hidden states alone `[N, H]`, with
    every token's keys and values in the cache as without it; the engine passes it on a step whose only rows read
    are those it samples (a prompt's last row beside decode rows), never on a replayed or split step.

    Encoder-decoder modules (`cross.py`): `cross_kv(states [B, F, H]) -> [B, layers, 2, F, kv_heads, head_dim]` turns
    a call's `cross_states` into the keys and values of a cross label, which each layer reads with
    `context.cross_attend(layer, q, scale)`. `process_logits(logits [N, V], histories) -> [N, V]` applies a
    module's own rules (suppressed tokens, timestamp pairs) to the sampled rows, from each row's tokens so far.
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


def _check_shape(module: Any, node: str, needs_vocab: bool = True) -> None:
    """`kv_cache_spec()` returns five sizes, or `config` has the fields the pool is sized from."""
    spec = getattr(module, "kv_cache_spec", None)
    if spec is not None:
        check_method(module, "kv_cache_spec", protocol_call(KVCacheSpec, "kv_cache_spec"), node=node, engine="kvcache")
        value = spec()
        sizes = tuple(value) if isinstance(value, tuple | list) else ()
        if len(sizes) != 5 or not all(isinstance(v, int) and v > 0 for v in sizes[: 4 if needs_vocab else 3]):
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
    missing = [k for k in ("num_hidden_layers", "vocab_size")[: 2 if needs_vocab else 1] if get(k) is None]
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


#: Outputs the engine produces itself: sampling ones (need `compute_logits`) and per-token hidden states.
SAMPLING_OUTPUTS = ("next_token", "finish_reason", "logprob", "top_logprobs", "logits")
BUILTIN_OUTPUTS = (*SAMPLING_OUTPUTS, "hidden")


def samples(node: Any) -> bool:
    """Whether the node's calls go through the LM head and the sampler (it declares `next_token` or `logits`)."""
    return "next_token" in node.outputs or "logits" in node.outputs


def call_inputs(module: Any, node: str) -> dict[str, str]:
    """The module's declared per-call tensors, checked."""
    declared = getattr(module, "call_inputs", None) or {}
    if not isinstance(declared, Mapping) or any(v not in ("token", "sequence") for v in declared.values()):
        raise ModuleContractError(f"{_where(node)}: module {type(module).__name__}.call_inputs must map input names "
                                  f"to 'token' or 'sequence', got {declared!r:.80}", node=node, engine="kvcache",
                                  method="call_inputs")
    return dict(declared)


def check_kvcache_module(module: Any, node: Any) -> None:
    """Raise `ModuleContractError` unless `module` meets `KVCacheModule` for `node`'s declared inputs and outputs."""
    from mstar_kvcache.inputs import BUILTIN_INPUTS

    embeds = "input_embeds" in node.all_inputs
    omit = () if embeds else ("input_embeds",)
    forward = protocol_call(KVCacheModule, "forward", omit)
    extra = call_inputs(module, node.name)
    unknown = [p for p in node.all_inputs if p not in BUILTIN_INPUTS and p not in extra]
    if unknown:
        raise ModuleContractError(
            f"{_where(node.name)}: inputs {unknown} are neither the engine's ({', '.join(BUILTIN_INPUTS)}) nor declared "
            f"by module {type(module).__name__} in `call_inputs`; declare them ({{name: 'token' | 'sequence'}})",
            node=node.name, engine="kvcache", method="call_inputs")
    kwargs = [p for p in node.all_inputs if p in extra or p == "routing"]
    if any(extra[p] == "sequence" for p in kwargs if p in extra):
        kwargs.append("sequence_index")
    forward = forward.replace(parameters=[*forward.parameters.values(), *keyword_call(kwargs).parameters.values()])
    check_method(module, "forward", forward, node=node.name, engine="kvcache")
    if samples(node):
        check_method(module, "compute_logits", protocol_call(KVCacheModule, "compute_logits"),
                     node=node.name, engine="kvcache", why="it turns the sampled rows' hidden states into logits")
    elif any(o in node.outputs for o in SAMPLING_OUTPUTS):
        bad = [o for o in SAMPLING_OUTPUTS if o in node.outputs]
        raise ModuleContractError(f"{_where(node.name)}: outputs {bad} come from sampling; declare 'next_token' too, or "
                                  "drop them (per-token outputs: 'hidden' or a module's compute_<name>)",
                                  node=node.name, engine="kvcache", method="outputs")
    for name in node.outputs:
        if name not in BUILTIN_OUTPUTS:
            check_method(module, f"compute_{name}", protocol_call(KVCacheModule, "compute_logits"),
                         node=node.name, engine="kvcache",
                         why=f"the node declares output '{name}', computed from the returned rows' hidden states")
    if embeds and "input_ids" in node.all_inputs:
        check_method(module, "embed", protocol_call(KVCacheModule, "embed"), node=node.name, engine="kvcache",
                     why="the node takes input 'input_embeds', spliced over the token embeddings")
    _check_shape(module, node.name, samples(node))
