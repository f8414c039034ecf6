"""Split any module built from the shared layers across a group, and name where each rank's slices come from.

`shard_layers` walks a module and replaces, under the subtrees it is told to split, every shared layer it
knows by this rank's share: `GroupedQueryAttention` by heads, `GatedMLP` by intermediate columns,
`TopKMoE` by experts or by each expert's columns (`mstar_core.nn.parallel.moe`), and the embeddings / LM
heads it is named by vocabulary rows. Every other parameter is replicated. The returned plan maps each
parameter of the split module to the checkpoint pieces it is read from (checkpoint names: fused q/k/v and
gate/up read as their parts, fused experts as one tensor per expert), so `fill_from_plan` can load a rank
from sliced safetensors without any rank holding the full weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

from mstar_core.checkpoint.meta import on_meta
from mstar_core.errors import ConfigError
from mstar_core.nn.mlp import GatedMLP
from mstar_core.nn.moe import FusedExperts, TopKMoE
from mstar_core.nn.parallel.group import TensorParallelGroup
from mstar_core.nn.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)
from mstar_core.nn.parallel.moe import ParallelMoE, moe_entries
from mstar_core.nn.parallel.sizes import check_divisible
from mstar_core.nn.parallel.slices import Entry, Piece, Stack
from mstar_core.nn.self_attention import GroupedQueryAttention

ShardPlan = dict[str, Entry]
#: The layer kinds `shard_layers` splits (a module with none of them under its split subtrees cannot be split).
SPLIT_KINDS = ("GroupedQueryAttention", "GatedMLP", "TopKMoE", "MoTAttention")


def _under(name: str, roots: Iterable[str]) -> bool:
    return any(root == "" or name == root or name.startswith(root + ".") for root in roots)


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def split_attention(attn: GroupedQueryAttention, group: TensorParallelGroup) -> GroupedQueryAttention:
    """A GQA layer over this rank's `heads / N` query and `kv_heads / N` KV heads (or the one KV head its query
    heads read, where ranks outnumber KV heads), built on the current device."""
    n, qkv = group.world_size, attn.qkv_proj
    norm = attn.q_norm
    local = GroupedQueryAttention(qkv.in_features, attn.num_heads // n, group.local_kv_heads(attn.num_kv_heads),
                                  attn.head_dim, attn.layer_idx, qkv_bias=qkv.bias is not None,
                                  o_bias=attn.o_proj.bias is not None,
                                  qk_norm=norm is not None, norm_eps=norm.eps if norm is not None else 1e-6)
    local.scale = attn.scale  # the full head_dim's scale, unchanged by the split
    local.qkv_proj = ColumnParallelLinear(qkv.in_features, local.q_size + 2 * local.kv_size, group,
                                          bias=qkv.bias is not None)
    local.o_proj = RowParallelLinear(local.q_size, attn.o_proj.out_features, group, bias=attn.o_proj.bias is not None)
    return local


def attention_entries(ckpt: str, group: TensorParallelGroup, heads: int, kv_heads: int, head_dim: int, *,
                      qkv_bias: bool, o_bias: bool, qk_norm: bool, suffix: str = "") -> ShardPlan:
    """Entries of a head-split attention (names relative to it; `suffix` for MoT's second expert)."""
    h0, h1 = group.shard(heads)
    k0, k1 = group.kv_shard(kv_heads)
    d = head_dim
    plan: ShardPlan = {}
    for leaf in ("weight", "bias") if qkv_bias else ("weight",):
        plan[f"qkv_proj{suffix}.{leaf}"] = [Piece(f"{ckpt}q_proj{suffix}.{leaf}", 0, h0 * d, h1 * d),
                                            Piece(f"{ckpt}k_proj{suffix}.{leaf}", 0, k0 * d, k1 * d),
                                            Piece(f"{ckpt}v_proj{suffix}.{leaf}", 0, k0 * d, k1 * d)]
    plan[f"o_proj{suffix}.weight"] = [Piece(f"{ckpt}o_proj{suffix}.weight", 1, h0 * d, h1 * d)]
    replicated = [f"o_proj{suffix}.bias"] if o_bias else []
    replicated += [f"q_norm{suffix}.weight", f"k_norm{suffix}.weight"] if qk_norm else []
    plan.update({name: [Piece(f"{ckpt}{name}")] for name in replicated})
    return plan


def split_mlp(mlp: GatedMLP, group: TensorParallelGroup) -> GatedMLP:
    """A gated MLP over this rank's `intermediate / N` columns; its down projection all-reduces."""
    hidden, bias = mlp.gate_up_proj.in_features, mlp.gate_up_proj.bias is not None
    inter = mlp.intermediate // group.world_size
    local = GatedMLP(hidden, inter, bias=bias)
    local.act = mlp.act
    local.gate_up_proj = ColumnParallelLinear(hidden, 2 * inter, group, bias=bias)
    local.down_proj = RowParallelLinear(inter, mlp.down_proj.out_features, group, bias=mlp.down_proj.bias is not None)
    return local


def mlp_entries(ckpt: str, group: TensorParallelGroup, intermediate: int, *, bias: bool, down_bias: bool) -> ShardPlan:
    """Entries of a column-split gated MLP (names relative to it)."""
    i0, i1 = group.shard(intermediate)
    plan: ShardPlan = {}
    for leaf in ("weight", "bias") if bias else ("weight",):
        plan[f"gate_up_proj.{leaf}"] = [Piece(f"{ckpt}gate_proj.{leaf}", 0, i0, i1),
                                        Piece(f"{ckpt}up_proj.{leaf}", 0, i0, i1)]
    plan["down_proj.weight"] = [Piece(f"{ckpt}down_proj.weight", 1, i0, i1)]
    if down_bias:
        plan["down_proj.bias"] = [Piece(f"{ckpt}down_proj.bias")]
    return plan


def replicated_entry(root: nn.Module, name: str, ckpt_prefix: str) -> Entry:
    """Where a replicated parameter is read from: its own name, or its parts when its linear is fused on load.

    `ckpt_prefix` is prepended as is (`"thinker."`), as in `shard_layers`.
    """
    owner_name, _, leaf = name.rpartition(".")
    owner_path, _, attr = owner_name.rpartition(".")
    owner = root.get_submodule(owner_path) if owner_name else root
    parts = getattr(owner, "checkpoint_parts", {}).get(attr) if owner_name else None
    if parts:
        return [Piece(ckpt_prefix + _join(owner_path, part, leaf)) for part in parts]
    module = root.get_submodule(owner_name) if owner_name else root
    if isinstance(module, FusedExperts) and leaf in ("gate_up_proj", "down_proj"):
        experts = ckpt_prefix + owner_name
        projs = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
        return Stack(tuple(tuple(Piece(f"{experts}.{e}.{p}.weight") for p in projs)
                           for e in range(module.num_experts)))
    return [Piece(ckpt_prefix + name)]


Splitter = Callable[[str, nn.Module], "tuple[nn.Module, ShardPlan] | None"]


def _splittable(root: nn.Module, split: tuple[str, ...], vocab: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """The layers `shard_layers` replaces, outermost first (nothing inside a layer already taken)."""
    found: list[tuple[str, nn.Module]] = []
    for name, sub in root.named_modules():
        if any(name.startswith(f + ".") for f, _ in found):
            continue
        if name in vocab or (name and _under(name, split) and (
                isinstance(sub, GroupedQueryAttention | GatedMLP | TopKMoE) or type(sub).__name__ == "MoTAttention")):
            found.append((name, sub))
    return found


def layer_dimensions(root: nn.Module, *, split: Iterable[str] = ("",), vocab: Iterable[str] = (),
                     expert_parallel: bool = False) -> dict[str, int]:
    """Every dimension `shard_layers` would split (heads, KV heads, intermediate, experts or their columns, vocab).

    A size must divide each; a name whose value differs between layers is keyed `"path: name"` as well.
    """
    dims: dict[str, int] = {}

    def need(name: str, path: str, value: int) -> None:
        dims[name if dims.get(name, value) == value else f"{path}: {name}"] = value

    for name, sub in _splittable(root, tuple(split), tuple(vocab)):
        if name in vocab:
            need("vocab_size", name, sub.weight.shape[0])
        elif isinstance(sub, GatedMLP):
            need("intermediate_size", name, sub.intermediate)
        elif isinstance(sub, TopKMoE):
            if expert_parallel:
                need("num_experts", name, sub.experts.num_experts)
            else:
                need("moe_intermediate_size", name, sub.experts.intermediate)
            if sub.shared_expert is not None:
                need("shared_expert_intermediate_size", name, sub.shared_expert.intermediate)
        else:
            need("num_attention_heads", name, sub.num_heads)
            need("num_key_value_heads", name, sub.num_kv_heads)
    return dims


def shard_layers(
    root: nn.Module,
    group: TensorParallelGroup,
    *,
    module: str,
    checkpoint_prefix: str = "",
    split: Iterable[str] = ("",),
    vocab: Iterable[str] = (),
    expert_parallel: bool | None = None,
    extra: Splitter | None = None,
) -> ShardPlan:
    """Replace `root`'s shared layers under the `split` subtrees by this rank's shards, on meta; returns the plan.

    `vocab` names embeddings (`nn.Embedding`) and LM heads (`nn.Linear`) split by vocabulary rows. MoE layers
    split by whole experts when `expert_parallel` (None: the group's own `expert_parallel`), else by columns.
    `extra` splits kinds this module does not know (called first; returns the new module and its relative
    entries, or None). Sizes are checked before anything changes: a ConfigError names `module`, the dimension
    and the sizes that divide every one. A module with nothing to split is a ConfigError naming it.
    """
    split, vocab = tuple(split), tuple(vocab)
    n = group.world_size
    expert_parallel = group.expert_parallel if expert_parallel is None else expert_parallel
    found = _splittable(root, split, vocab)
    if not any(name not in vocab for name, _ in found):
        raise ConfigError(f"{module}: {type(root).__name__} cannot be split for tensor_parallel {n}: none of its "
                          f"layers under {list(split)} is one the shared library splits ({', '.join(SPLIT_KINDS)})")
    check_divisible(module, layer_dimensions(root, split=split, vocab=vocab, expert_parallel=expert_parallel), n)
    plan: ShardPlan = {}
    with on_meta():  # meta tensors without running their initialisers (which import torch._refs: seconds)
        for name, sub in found:
            ckpt = f"{checkpoint_prefix}{name}."
            made = extra(name, sub) if extra is not None else None
            if made is not None:
                local, entries = made
            elif name in vocab and isinstance(sub, nn.Embedding):
                local = VocabParallelEmbedding(sub.num_embeddings, sub.embedding_dim, group)
                v0, v1 = local.start, local.stop
                entries = {"weight": [Piece(f"{ckpt}weight", 0, v0, v1)]}
            elif name in vocab:
                local = VocabParallelLMHead(sub.in_features, sub.out_features, group)
                entries = {"weight": [Piece(f"{ckpt}weight", 0, local.start, local.stop)]}
            elif isinstance(sub, GroupedQueryAttention):
                local = split_attention(sub, group)
                entries = attention_entries(ckpt, group, sub.num_heads, sub.num_kv_heads, sub.head_dim,
                                            qkv_bias=sub.qkv_proj.bias is not None,
                                            o_bias=sub.o_proj.bias is not None, qk_norm=sub.q_norm is not None)
            elif isinstance(sub, GatedMLP):
                local = split_mlp(sub, group)
                entries = mlp_entries(ckpt, group, sub.intermediate, bias=sub.gate_up_proj.bias is not None,
                                      down_bias=sub.down_proj.bias is not None)
            elif isinstance(sub, TopKMoE):
                local = ParallelMoE(sub, group, expert_parallel=expert_parallel)
                shared = sub.shared_expert.intermediate if sub.shared_expert is not None else None
                entries = moe_entries(local, ckpt, group, sub.experts.intermediate, shared)
            else:
                raise ConfigError(f"{module}: no splitter for {name} ({type(sub).__name__})")
            owner, _, attr = name.rpartition(".")
            setattr(root.get_submodule(owner) if owner else root, attr, local)
            plan.update({f"{name}.{k}": v for k, v in entries.items()})
    for name, _ in root.named_parameters():
        if name not in plan:
            plan[name] = replicated_entry(root, name, checkpoint_prefix)
    root.tensor_parallel = group
    return plan
