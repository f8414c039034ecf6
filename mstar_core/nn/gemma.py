"""Gemma (v1) decoder over packed tokens: (1 + w) RMSNorm, GeGLU MLP, embeddings scaled by √width, MQA, RoPE.

Meets the `kvcache` module contract (`forward(input_ids, positions, context, input_embeds=...)`, `embed`,
`compute_logits`), so PaliGemma's language model and pi0's action expert run on the shared engine.
Parameter names are HF `GemmaModel`'s (`embed_tokens`, `layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp.{gate,up,down}_proj}`, `norm`), so a checkpoint's subtree loads by prefix.

A layer's norms may be adaptive (`AdaRMSNorm`, pi0.5's action expert): a conditioning vector per token
gives (scale, shift, gate), and the residual adds `gate * out` instead of `out`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import nn

from mstar_core.config.hf import check, config_field, dotted, read_fields, section
from mstar_core.nn.attention import AttentionContext
from mstar_core.nn.logits import lm_logits
from mstar_core.nn.mlp import GatedMLP
from mstar_core.nn.rotary import RotaryEmbedding
from mstar_core.nn.self_attention import GroupedQueryAttention


class GemmaRMSNorm(nn.Module):
    """RMS norm scaled by `(1 + weight)` (weight initialised at 0), computed in fp32 and cast back after scaling."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class AdaRMSNorm(nn.Module):
    """Adaptive RMS norm: `dense(cond)` gives (scale, shift, gate); returns `x̂(1 + scale) + shift` and `gate`.

    `cond` is `[T, cond_dim]` (one row per token). The checkpoint name of the projection is `dense`.
    """

    def __init__(self, dim: int, cond_dim: int, eps: float = 1e-6):
        super().__init__()
        self.dense = nn.Linear(cond_dim, 3 * dim)
        self.eps = eps

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        scale, shift, gate = self.dense(cond).chunk(3, dim=-1)
        out = h * (1.0 + scale.float()) + shift.float()
        return out.to(x.dtype), gate.to(x.dtype)


def _norm(dim: int, eps: float, cond_dim: int | None) -> nn.Module:
    return GemmaRMSNorm(dim, eps) if cond_dim is None else AdaRMSNorm(dim, cond_dim, eps)


def _apply_norm(norm: nn.Module, x: torch.Tensor, cond: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(norm, AdaRMSNorm):
        if cond is None:
            raise ValueError("this Gemma has adaptive norms: forward needs `cond` (one row per token)")
        return norm(x, cond)
    return norm(x), None


# reader defaults for keys a HF Gemma config may leave out: PaliGemma's vocabulary, MHA, hidden / heads
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 257152,
    "num_key_value_heads": lambda values: values["num_attention_heads"],
    "head_dim": lambda values: values["hidden_size"] // values["num_attention_heads"],
}


@attrs.frozen(kw_only=True)
class GemmaConfig:
    """Decoder hyper-parameters; `GemmaConfig.from_hf(config_dict)` reads a HF `gemma` text config strictly."""

    vocab_size: int = config_field(minimum=1)
    hidden_size: int = config_field(minimum=1)
    intermediate_size: int = config_field(minimum=1)
    num_hidden_layers: int = config_field(minimum=1)
    num_attention_heads: int = config_field(minimum=1)
    num_key_value_heads: int = config_field(minimum=1)
    head_dim: int = config_field(minimum=1)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    hidden_act: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 8192
    adarms_cond_dim: int | None = None  # set: every norm is an AdaRMSNorm conditioned on a vector of this width

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], where: str = "", *, file: str = "config.json",
                **overrides: Any) -> GemmaConfig:
        """Read a HF Gemma config dict (section `where` of `file`); a missing or mistyped key raises `ConfigError`."""
        cfg = section(cfg, where, file=file)
        rope = section(cfg.get("rope_parameters"), dotted(where, "rope_parameters"), file=file)
        theta_key = "rope_parameters.rope_theta" if rope.get("rope_theta") is not None else "rope_theta"
        theta = rope.get("rope_theta", cfg.get("rope_theta"))
        # transformers names it `hidden_activation` (Gemma 1.1 on) and keeps `hidden_act` for older files
        act_key = "hidden_activation" if cfg.get("hidden_activation") is not None else "hidden_act"
        act = cfg.get(act_key)
        values = dict(
            rope_theta=10000.0 if theta is None else check(theta, float, dotted(where, theta_key), file=file),
            hidden_act="gelu_pytorch_tanh" if act is None else check(act, str, dotted(where, act_key), file=file),
        )
        return read_fields(cls, cfg, where, file=file, defaults=_DEFAULTS, **{**values, **overrides})

    def to_hf(self) -> dict[str, Any]:
        """The HF `gemma` config dict for these sizes."""
        out = attrs.asdict(self)
        out.pop("adarms_cond_dim")
        out["hidden_activation"] = out["hidden_act"]
        out["model_type"] = "gemma"
        return out


class GemmaDecoderLayer(nn.Module):
    """Pre-norm block: `x + attn(norm(x))`, `x + mlp(norm(x))` (each `+ gate * ...` with adaptive norms)."""

    def __init__(self, cfg: GemmaConfig, layer_idx: int):
        super().__init__()
        cond = cfg.adarms_cond_dim
        self.input_layernorm = _norm(cfg.hidden_size, cfg.rms_norm_eps, cond)
        self.self_attn = GroupedQueryAttention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, layer_idx
        )
        self.post_attention_layernorm = _norm(cfg.hidden_size, cfg.rms_norm_eps, cond)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def attention_input(self, x: torch.Tensor, cond: torch.Tensor | None = None):
        """The normed input of the attention and its residual gate (None without adaptive norms)."""
        return _apply_norm(self.input_layernorm, x, cond)

    def finish(self, x: torch.Tensor, attn_out: torch.Tensor, gate: torch.Tensor | None,
               cond: torch.Tensor | None = None) -> torch.Tensor:
        """Residual of the attention output (already projected by `o_proj`), then the MLP half."""
        x = x + (attn_out if gate is None else gate * attn_out)
        h, gate = _apply_norm(self.post_attention_layernorm, x, cond)
        out = self.mlp(h)
        return x + (out if gate is None else gate * out)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], context: AttentionContext,
                cond: torch.Tensor | None = None) -> torch.Tensor:
        h, gate = self.attention_input(x, cond)
        return self.finish(x, self.self_attn(h, rope, context), gate, cond)


class GemmaDecoder(nn.Module):
    """Gemma embeddings (optional), layers and final norm over packed tokens; the kvcache engine's module."""

    def __init__(self, cfg: GemmaConfig, embeddings: bool = True):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if embeddings else None
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = _norm(cfg.hidden_size, cfg.rms_norm_eps, cfg.adarms_cond_dim)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, {"rope_type": "default", "rope_theta": cfg.rope_theta})

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings times √width (rounded to the weights' dtype first, as Gemma does)."""
        if self.embed_tokens is None:
            raise ValueError("this Gemma has no token embeddings (an action expert): pass input_embeds")
        weight = self.embed_tokens.weight
        return self.embed_tokens(input_ids) * torch.tensor(self.config.hidden_size**0.5, dtype=weight.dtype)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        context: AttentionContext,
        input_embeds: torch.Tensor | None = None,
        cond: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Packed ids `[T]` (or `input_embeds` `[T, H]`, used as given: not scaled) -> final-normed hidden `[T, H]`."""
        x = self.embed(input_ids) if input_embeds is None else input_embeds
        rope = self.rotary_emb(positions.reshape(-1))
        for layer in self.layers:
            x = layer(x, rope, context, cond)
        return _apply_norm(self.norm, x, cond)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied LM head: hidden `[N, H]` -> logits `[N, vocab]`."""
        if self.embed_tokens is None:
            raise ValueError("this Gemma has no token embeddings, hence no LM head")
        return lm_logits(self.embed_tokens, hidden)
