"""SigLIP vision transformer: patch embedding, learned positions, pre-LN blocks, post-LN (no pooling head).

Parameter names are HF `SiglipVisionTransformer`'s (`embeddings.{patch_embedding, position_embedding}`,
`encoder.layers.N.{layer_norm1, self_attn.{q,k,v,out}_proj, layer_norm2, mlp.fc1, mlp.fc2}`,
`post_layernorm`), so the `vision_model.*` / `vision_tower.*` subtree of a checkpoint loads by prefix.
Images attend within themselves only, so this runs dense (no KV cache): a stateless-engine module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.config.hf import config_field, dotted, read_fields
from mstar_core.errors import ConfigError
from mstar_core.nn.fused import fuse_on_load
from mstar_core.nn.mlp import MLP
from mstar_core.nn.norm import LayerNorm


@attrs.frozen(kw_only=True)
class SiglipVisionConfig:
    """Vision tower sizes; `from_hf` reads a HF `siglip_vision_model` config dict strictly."""

    hidden_size: int = config_field(minimum=1)
    intermediate_size: int = config_field(minimum=1)
    num_hidden_layers: int = config_field(minimum=1)
    num_attention_heads: int = config_field(minimum=1)
    image_size: int = config_field(minimum=1)
    patch_size: int = config_field(minimum=1)
    num_channels: int = config_field(3, minimum=1)
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], where: str = "", *, file: str = "config.json") -> SiglipVisionConfig:
        """Read a HF SigLIP vision config (section `where` of `file`); a bad or missing key raises `ConfigError`."""
        out = read_fields(cls, cfg, where, file=file)
        if out.hidden_size % out.num_attention_heads:
            raise ConfigError(f"{file}: key '{dotted(where, 'hidden_size')}' ({out.hidden_size}) must be a multiple "
                              f"of num_attention_heads ({out.num_attention_heads})")
        return out

    def to_hf(self) -> dict[str, Any]:
        return {"model_type": "siglip_vision_model", **attrs.asdict(self)}


class SiglipAttention(nn.Module):
    """Multi-head self-attention over one image's patches (all see all), biases on every projection.

    q, k and v are one linear (`qkv_proj`); state dicts keep the checkpoint's `q_proj`/`k_proj`/`v_proj`
    (see `mstar_core.nn.fused`).
    """

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv_proj = nn.Linear(hidden, 3 * hidden)
        self.out_proj = nn.Linear(hidden, hidden)
        fuse_on_load(self, "qkv_proj", [("q_proj", hidden), ("k_proj", hidden), ("v_proj", hidden)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv_proj(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: SiglipVisionConfig):
        super().__init__()
        self.layer_norm1 = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = SiglipAttention(cfg.hidden_size, cfg.num_attention_heads)
        self.layer_norm2 = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: SiglipVisionConfig):
        super().__init__()
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.num_patches, cfg.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight[None]


class SiglipEncoder(nn.Module):
    def __init__(self, cfg: SiglipVisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))


class SiglipVisionTransformer(nn.Module):
    """Pixels `[B, C, S, S]` (S = image_size, values in [-1, 1]) -> patch features `[B, (S/p)², hidden]`."""

    def __init__(self, cfg: SiglipVisionConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg)
        self.post_layernorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        s = self.config.image_size
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (self.config.num_channels, s, s):
            raise ValueError(f"SigLIP expects pixels [B, {self.config.num_channels}, {s}, {s}], got {tuple(pixels.shape)}")
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
