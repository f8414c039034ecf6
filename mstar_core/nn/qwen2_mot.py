"""Qwen2-style mixture-of-transformers decoder (BAGEL's LLM): two full weight sets per layer, one shared attention.

Each layer holds an "und" expert (text and ViT tokens: `input_layernorm`, `self_attn.{q,k,v,o}_proj`,
`self_attn.{q,k}_norm`, `post_attention_layernorm`, `mlp`) and a "gen" expert for VAE-latent tokens (the
same names with a `_moe_gen` suffix), plus `norm` / `norm_moe_gen` at the end. Tokens are routed per row
(`routing` 0 = und, 1 = gen); both experts' queries, keys and values meet in one `context.attend` per
layer, so a latent token sees the text before it and the text's cache holds keys from both experts.
q/k/v carry biases and q/k get a per-head RMSNorm before RoPE (Qwen3's layer with `attention_bias`).
Names follow the published checkpoint (`language_model.model.*`), q/k/v and gate/up fused on load.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from mstar_core.config.hf import check
from mstar_core.nn.attention import AttentionContext
from mstar_core.nn.fused import fuse_on_load
from mstar_core.nn.llama_config import LlamaConfig
from mstar_core.nn.logits import lm_logits
from mstar_core.nn.mlp import GatedMLP
from mstar_core.nn.norm import RMSNorm
from mstar_core.nn.rotary import RotaryEmbedding, apply_rotary

GEN = "_moe_gen"


def mot_config(cfg: dict) -> LlamaConfig:
    """A BAGEL `llm_config.json` (model_type qwen2, `qk_norm`, `layer_module`) as the decoder's config."""
    plain = {k: v for k, v in cfg.items() if k not in ("qk_norm", "layer_module", "freeze_und", "is_causal")}
    plain["model_type"] = "qwen2"
    base = LlamaConfig.from_hf(plain, file="llm_config.json")
    # strictly a JSON boolean (bool("false") would be True); absent or null: BAGEL's qk-norm on
    qk_norm = check(True if cfg.get("qk_norm") is None else cfg["qk_norm"], bool, "qk_norm", file="llm_config.json")
    return attrs.evolve(base, qkv_bias=True, o_bias=False, qk_norm=qk_norm)


class MoTAttention(nn.Module):
    """q/k/v per expert, one attention over all rows, o_proj per expert."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        for suffix in ("", GEN):
            qkv = f"qkv_proj{suffix}"
            setattr(self, qkv, nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=True))
            fuse_on_load(self, qkv, [(f"q_proj{suffix}", self.q_size), (f"k_proj{suffix}", self.kv_size),
                                     (f"v_proj{suffix}", self.kv_size)])
            setattr(self, f"o_proj{suffix}", nn.Linear(self.q_size, cfg.hidden_size, bias=False))
            norm = cfg.qk_norm
            setattr(self, f"q_norm{suffix}", RMSNorm(self.head_dim, cfg.rms_norm_eps) if norm else None)
            setattr(self, f"k_norm{suffix}", RMSNorm(self.head_dim, cfg.rms_norm_eps) if norm else None)

    def qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], suffix: str):
        t = x.shape[0]
        q, k, v = getattr(self, f"qkv_proj{suffix}")(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        qn, kn = getattr(self, f"q_norm{suffix}"), getattr(self, f"k_norm{suffix}")
        if qn is not None:
            q, k = qn(q), kn(k)
        return apply_rotary(q, *rope), apply_rotary(k, *rope), v.view(t, self.num_kv_heads, self.head_dim)


class MoTDecoderLayer(nn.Module):
    """Pre-norm block whose norms, projections and MLP are chosen per row by its expert."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int):
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = MoTAttention(cfg, layer_idx)
        for suffix in ("", GEN):
            setattr(self, f"input_layernorm{suffix}", RMSNorm(h, cfg.rms_norm_eps))
            setattr(self, f"post_attention_layernorm{suffix}", RMSNorm(h, cfg.rms_norm_eps))
            setattr(self, f"mlp{suffix}", GatedMLP(h, cfg.intermediate_size, cfg.hidden_act))

    def _dense(self, x, rope, context, suffix: str) -> torch.Tensor:
        attn = self.self_attn
        q, k, v = attn.qkv(getattr(self, f"input_layernorm{suffix}")(x), rope, suffix)
        out = context.attend(attn.layer_idx, q, k, v, attn.scale).reshape(x.shape[0], -1)
        x = x + getattr(attn, f"o_proj{suffix}")(out)
        return x + getattr(self, f"mlp{suffix}")(getattr(self, f"post_attention_layernorm{suffix}")(x))

    def forward(self, x: torch.Tensor, rope, context: AttentionContext, split=None) -> torch.Tensor:
        """`split` = (und row index, gen row index) when both experts have rows; else all rows go to `expert`."""
        if not isinstance(split, tuple):
            return self._dense(x, rope, context, split or "")
        iu, ig = split
        attn = self.self_attn
        ropes = ((rope[0][iu], rope[1][iu]), (rope[0][ig], rope[1][ig]))
        parts = [attn.qkv(getattr(self, f"input_layernorm{s}")(x[i]), r, s)
                 for i, r, s in ((iu, ropes[0], ""), (ig, ropes[1], GEN))]
        t = x.shape[0]
        q, k, v = (parts[0][j].new_empty(t, *parts[0][j].shape[1:]).index_copy_(0, iu, parts[0][j]).index_copy_(0, ig, parts[1][j])
                   for j in range(3))
        out = context.attend(attn.layer_idx, q, k, v, attn.scale).reshape(t, -1)
        y = torch.empty_like(x)
        for i, s in ((iu, ""), (ig, GEN)):
            h = x[i] + getattr(attn, f"o_proj{s}")(out[i])
            y[i] = h + getattr(self, f"mlp{s}")(getattr(self, f"post_attention_layernorm{s}")(h))
        return y


class MoTModel(nn.Module):
    """Embeddings, MoT layers, `norm` and `norm_moe_gen` (checkpoint prefix `language_model.model.`)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MoTDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm_moe_gen = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope)


class MoTForCausalLM(nn.Module):
    """Packed tokens in (ids or embeddings, positions, per-row expert ids), final hidden `[T, H]` out."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = MoTModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def forward(self, input_ids, positions, context: AttentionContext, input_embeds=None, routing=None) -> torch.Tensor:
        x = self.embed(input_ids) if input_embeds is None else input_embeds
        rope = self.model.rotary_emb(positions.reshape(-1))
        split: tuple | str = ""
        if routing is not None:
            gen = routing.to(x.device) == 1
            n_gen = int(gen.sum())
            if n_gen == x.shape[0]:
                split = GEN
            elif n_gen:
                split = ((~gen).nonzero().flatten(), gen.nonzero().flatten())
        for layer in self.model.layers:
            x = layer(x, rope, context, split)
        if isinstance(split, tuple):
            y = torch.empty_like(x)
            y[split[0]] = self.model.norm(x[split[0]])
            y[split[1]] = self.model.norm_moe_gen(x[split[1]])
            return y
        return (self.model.norm_moe_gen if split == GEN else self.model.norm)(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return lm_logits(self.lm_head, hidden)
