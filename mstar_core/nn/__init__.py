"""Shared torch building blocks that model packages import (norms, rotary, attention, MLPs, MoE)."""

from mstar_core.nn.attention import AttentionContext, DenseAttention, DenseKVCache
from mstar_core.nn.cross_attention import CrossAttention, DenseCrossContext
from mstar_core.nn.llama import LlamaForCausalLM, load_llama
from mstar_core.nn.llama_config import LlamaConfig
from mstar_core.nn.mlp import MLP, GatedMLP, SwiGLU
from mstar_core.nn.moe import FusedExperts, TopKMoE
from mstar_core.nn.norm import LayerNorm, RMSNorm
from mstar_core.nn.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from mstar_core.nn.self_attention import GroupedQueryAttention

__all__ = [
    "MLP",
    "AttentionContext",
    "CrossAttention",
    "DenseAttention",
    "DenseCrossContext",
    "DenseKVCache",
    "FusedExperts",
    "GatedMLP",
    "GroupedQueryAttention",
    "LayerNorm",
    "LlamaConfig",
    "LlamaForCausalLM",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLU",
    "TopKMoE",
    "apply_rotary",
    "load_llama",
    "rope_parameters",
]
