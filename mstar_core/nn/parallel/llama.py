"""Split a Llama-family decoder (`mstar_core.nn.llama`) across a tensor-parallel group, or load it split.

Attention is split by heads: each rank holds `heads / N` query heads and `kv_heads / N` KV heads (its
rows of q_proj, k_proj, v_proj and their biases; its columns of o_proj), so its KV cache holds only its
heads. Where the ranks outnumber the KV heads (a multiple of them), each rank holds the one KV head its query
heads read (`TensorParallelGroup.kv_shard`), replicated on `N / kv_heads` ranks. The MLP is split by intermediate columns (gate/up rows, down columns); the embedding and an
untied LM head by vocabulary rows, a tied head reuses the embedding's shard. Norms (and the biases of
row-parallel linears, added once after the sum) are replicated.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mstar_core.checkpoint import read_config
from mstar_core.checkpoint.errors import CheckpointError
from mstar_core.checkpoint.meta import on_meta
from mstar_core.nn.llama import LlamaForCausalLM, load_llama
from mstar_core.nn.llama_config import LlamaConfig
from mstar_core.nn.mlp import GatedMLP
from mstar_core.nn.parallel.group import TensorParallelGroup
from mstar_core.nn.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)
from mstar_core.nn.parallel.sizes import check_divisible, llama_dimensions
from mstar_core.nn.parallel.slices import (
    Entry,
    Piece,
    SafetensorsSlices,
    SliceSource,
    StateDictSlices,
    entry_names,
    read_pieces,
)
from mstar_core.nn.self_attention import GroupedQueryAttention

ShardPlan = dict[str, Entry]


def llama_shard_plan(cfg: LlamaConfig, group: TensorParallelGroup) -> ShardPlan:
    """This rank's parameters (split model's names) -> the checkpoint pieces each is read from (HF names)."""
    d = cfg.head_dim
    h0, h1 = group.shard(cfg.num_attention_heads)
    k0, k1 = group.kv_shard(cfg.num_key_value_heads)
    i0, i1 = group.shard(cfg.intermediate_size)
    v0, v1 = group.shard(cfg.vocab_size)
    plan: ShardPlan = {"model.embed_tokens.weight": [Piece("model.embed_tokens.weight", 0, v0, v1)]}
    for i in range(cfg.num_hidden_layers):
        layer, attn, mlp = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for suffix in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            plan[f"{attn}qkv_proj.{suffix}"] = [Piece(f"{attn}q_proj.{suffix}", 0, h0 * d, h1 * d),
                                                Piece(f"{attn}k_proj.{suffix}", 0, k0 * d, k1 * d),
                                                Piece(f"{attn}v_proj.{suffix}", 0, k0 * d, k1 * d)]
        plan[f"{attn}o_proj.weight"] = [Piece(f"{attn}o_proj.weight", 1, h0 * d, h1 * d)]
        for suffix in ("weight", "bias") if cfg.mlp_bias else ("weight",):
            plan[f"{mlp}gate_up_proj.{suffix}"] = [Piece(f"{mlp}gate_proj.{suffix}", 0, i0, i1),
                                                   Piece(f"{mlp}up_proj.{suffix}", 0, i0, i1)]
        plan[f"{mlp}down_proj.weight"] = [Piece(f"{mlp}down_proj.weight", 1, i0, i1)]
        replicated = [f"{layer}input_layernorm.weight", f"{layer}post_attention_layernorm.weight"]
        replicated += [f"{attn}o_proj.bias"] if cfg.o_bias else []
        replicated += [f"{mlp}down_proj.bias"] if cfg.mlp_bias else []
        replicated += [f"{attn}q_norm.weight", f"{attn}k_norm.weight"] if cfg.qk_norm else []
        plan.update({name: [Piece(name)] for name in replicated})
    plan["model.norm.weight"] = [Piece("model.norm.weight")]
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = [Piece("lm_head.weight", 0, v0, v1)]
    return plan


def _split_attention(attn: GroupedQueryAttention, cfg: LlamaConfig, group: TensorParallelGroup,
                     layer_idx: int) -> GroupedQueryAttention:
    n = group.world_size
    kv_heads = group.local_kv_heads(cfg.num_key_value_heads)
    local = GroupedQueryAttention(cfg.hidden_size, cfg.num_attention_heads // n, kv_heads, cfg.head_dim, layer_idx,
                                  qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, qk_norm=cfg.qk_norm,
                                  norm_eps=cfg.rms_norm_eps)
    local.scale = attn.scale  # the full head_dim's scale, unchanged by the split
    local.qkv_proj = ColumnParallelLinear(cfg.hidden_size, local.q_size + 2 * local.kv_size, group,
                                          bias=cfg.qkv_bias)
    local.o_proj = RowParallelLinear(local.q_size, cfg.hidden_size, group, bias=cfg.o_bias)
    return local


def _split_mlp(cfg: LlamaConfig, group: TensorParallelGroup) -> GatedMLP:
    inter = cfg.intermediate_size // group.world_size
    local = GatedMLP(cfg.hidden_size, inter, cfg.hidden_act, bias=cfg.mlp_bias)
    local.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, 2 * inter, group, bias=cfg.mlp_bias)
    local.down_proj = RowParallelLinear(inter, cfg.hidden_size, group, bias=cfg.mlp_bias)
    return local


def fill_from_plan(model: nn.Module, plan: ShardPlan, source: SliceSource, *, dtype: torch.dtype | None = None,
                   device: torch.device | str = "cpu") -> None:
    """Give every parameter of `model` the slice `plan` names, read from `source`; a shape or name gap raises."""
    params = dict(model.named_parameters())
    if set(params) != set(plan):
        raise CheckpointError(f"shard plan and split model disagree: plan only {sorted(set(plan) - set(params))}, "
                              f"model only {sorted(set(params) - set(plan))}")
    for name, pieces in plan.items():
        tensor = read_pieces(source, pieces, dtype).to(device)
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise CheckpointError(f"{name}: read {list(tensor.shape)} from {entry_names(pieces)[:4]}, this rank "
                                  f"expects {list(params[name].shape)}")
        owner_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner_name), leaf, nn.Parameter(tensor, requires_grad=False))


def shard_llama(model: LlamaForCausalLM, group: TensorParallelGroup, *, module: str = "llama") -> ShardPlan:
    """Replace `model`'s layers in place by this rank's shards; returns the plan saying where each slice comes from.

    A model with real weights keeps them (each rank slices the full tensors it holds); a model built on the
    meta device is left on meta, for `fill_from_plan` to load from sliced files.
    """
    cfg = model.config
    check_divisible(module, llama_dimensions(cfg), group.world_size)
    plan = llama_shard_plan(cfg, group)
    weight = model.model.embed_tokens.weight
    full = None if weight.is_meta else StateDictSlices(model.state_dict(), where=module)
    dtype = weight.dtype
    with on_meta():  # meta tensors without running their initialisers (which import torch._refs: seconds)
        for i, layer in enumerate(model.model.layers):
            layer.self_attn = _split_attention(layer.self_attn, cfg, group, i)
            layer.mlp = _split_mlp(cfg, group)
        embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group)
        model.model.embed_tokens = embed
        if cfg.tie_word_embeddings:
            model.tied_head = VocabParallelLMHead(cfg.hidden_size, cfg.vocab_size, group, tied_to=embed)
        else:
            model.lm_head = VocabParallelLMHead(cfg.hidden_size, cfg.vocab_size, group)
    if full is not None:
        fill_from_plan(model, plan, full, dtype=dtype, device=weight.device)
    model.tensor_parallel = group
    return plan


def load_llama_tensor_parallel(
    directory: str | Path,
    group: TensorParallelGroup,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    module: str = "llama",
) -> LlamaForCausalLM:
    """Load this rank's shard of a HF Llama/Qwen2/Qwen3 safetensors checkpoint, reading only its slices."""
    cfg = LlamaConfig.from_hf(read_config(directory))
    check_divisible(module, llama_dimensions(cfg), group.world_size)  # before any byte is read
    with on_meta():  # meta tensors without running their initialisers (which import torch._refs: seconds)
        model = LlamaForCausalLM(cfg)
    plan = shard_llama(model, group, module=module)
    with SafetensorsSlices(directory) as source:
        fill_from_plan(model, plan, source, dtype=dtype, device=device)
    return model.eval()


def load_llama_for_rank(directory: str | Path, group: TensorParallelGroup | None, *, dtype: torch.dtype | None,
                        device: str | torch.device, module: str, progress: bool = True) -> LlamaForCausalLM:
    """A Llama/Qwen checkpoint as this rank holds it: only its slices in a group of 2+, else the whole model."""
    # (a worker builds the nodes it does not host on the meta device: nothing to read for those)
    if group is not None and group.world_size > 1 and str(device) != "meta":
        return load_llama_tensor_parallel(directory, group, dtype=dtype, device=device, module=module)
    return load_llama(directory, dtype=dtype, device=device, progress=progress)
