"""The Qwen3 decoder stack (q/k-norm, GQA, interleaved M-RoPE; MoE or dense MLP per layer) over packed tokens.

Shared by Qwen3-Omni's Thinker text model and Talker (MoE) and Qwen3-TTS's Talker (dense: `num_experts` 0).
Parameter names are the checkpoint's (`layers.N.self_attn.{q,k,v,o}_proj`, `q_norm`, `k_norm`,
`mlp.gate`, `mlp.experts.E.*` fused at load, `mlp.shared_expert*` for Omni's Talker, `mlp.{gate,up,down}_proj`
for a dense layer, `norm`).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from mstar_core.nn.attention import AttentionContext
from mstar_core.nn.mlp import GatedMLP
from mstar_core.nn.moe import TopKMoE
from mstar_core.nn.mrope import MultimodalRotaryEmbedding
from mstar_core.nn.norm import RMSNorm
from mstar_core.nn.self_attention import GroupedQueryAttention


class Qwen3DecoderConfig(Protocol):
    """The sizes the stack reads (an attrs config of the model package)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    rms_norm_eps: float
    attention_bias: bool
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    rope_theta: float
    mrope_section: tuple[int, ...]

    def is_moe_layer(self, i: int) -> bool: ...


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)) with q/k-norm, then x + moe(norm(x)) (or a dense MLP)."""

    def __init__(self, cfg: Qwen3DecoderConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GroupedQueryAttention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, layer_idx,
            qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True, norm_eps=cfg.rms_norm_eps,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = TopKMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                               norm_topk_prob=cfg.norm_topk_prob, act=cfg.hidden_act,
                               shared_intermediate=cfg.shared_expert_intermediate_size or None)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], context: AttentionContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, context)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Decoder(nn.Module):
    """Decoder layers + final norm over packed tokens; optionally adds deepstack rows and keeps one layer's output."""

    def __init__(self, cfg: Qwen3DecoderConfig):
        super().__init__()
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = MultimodalRotaryEmbedding(cfg.head_dim, cfg.mrope_section, cfg.rope_theta, interleaved=True)

    def run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        context: AttentionContext,
        deepstack: torch.Tensor | None = None,
        keep_layer: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`x` `[T, H]` at `positions` (`[3, T]` or `[T]`) -> (normed final hidden, output of layer `keep_layer`).

        `deepstack` `[T, K, H]`: row k is added to the output of layer k (zeros on tokens that have none).
        `keep_layer` counts as HF's `hidden_states` index does: 0 the input, i the output of layer i - 1
        (before that layer's deepstack row), the last one the normed output.
        """
        rope = self.rotary_emb(positions)
        kept = x if keep_layer == 0 else None
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, context)
            if keep_layer == i + 1 and keep_layer < len(self.layers):
                kept = x
            if deepstack is not None and i < deepstack.shape[1]:
                x = x + deepstack[:, i].to(x.dtype)
        x = self.norm(x)
        if keep_layer == len(self.layers):
            kept = x
        return x, kept
