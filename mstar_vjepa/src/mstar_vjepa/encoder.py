"""The V-JEPA 2 video encoder: Conv3d tubelet stem, pre-norm ViT blocks with 3-D RoPE, final LayerNorm.

Parameter names follow the HF `VJEPA2Model` layout (`encoder.*`), so HF safetensors load without renaming.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar_vjepa.config import VJEPA2Config
from mstar_vjepa.rope import grid_positions, rotate_3d


class RopeSelfAttention(nn.Module):
    """Bidirectional multi-head attention with separate q/k/v projections and 3-D RoPE on q and k."""

    def __init__(self, dim: int, heads: int, qkv_bias: bool = True):
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.query = nn.Linear(dim, dim, bias=qkv_bias)
        self.key = nn.Linear(dim, dim, bias=qkv_bias)
        self.value = nn.Linear(dim, dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, pos: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x `[B, N, dim]`; pos = (frame, row, col), each `[N]` or `[B, N]`."""
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.heads, self.head_dim).transpose(1, 2) for p in (self.query, self.key, self.value))
        pos = tuple(p.unsqueeze(-2) if p.dim() == 2 else p for p in pos)  # [B, 1, N] broadcasts over heads
        q, k = rotate_3d(q, *pos), rotate_3d(k, *pos)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))


class Mlp(nn.Module):
    """fc1 -> exact GELU -> fc2."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class RopeBlock(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, eps: float, qkv_bias: bool = True):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attention = RopeSelfAttention(dim, heads, qkv_bias)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor, pos: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attention(self.norm1(x), pos)
        return x + self.mlp(self.norm2(x))


class _PatchEmbeddings(nn.Module):
    def __init__(self, cfg: VJEPA2Config):
        super().__init__()
        kernel = (cfg.tubelet_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_chans, cfg.hidden_size, kernel_size=kernel, stride=kernel)


class _Embeddings(nn.Module):
    def __init__(self, cfg: VJEPA2Config):
        super().__init__()
        self.patch_embeddings = _PatchEmbeddings(cfg)


class VJEPA2Encoder(nn.Module):
    """Video `[B, T, C, H, W]` -> patch latents `[B, (T/tubelet) * (H/p) * (W/p), hidden]`."""

    def __init__(self, cfg: VJEPA2Config):
        super().__init__()
        self.cfg = cfg
        self.embeddings = _Embeddings(cfg)
        self.layer = nn.ModuleList(
            RopeBlock(cfg.hidden_size, cfg.num_attention_heads, cfg.mlp_ratio, cfg.layer_norm_eps, cfg.qkv_bias)
            for _ in range(cfg.num_hidden_layers)
        )
        self.layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        x = video.permute(0, 2, 1, 3, 4)  # [B, C, T, H, W] for the Conv3d stem
        if x.shape[2] < cfg.tubelet_size:  # a single image becomes one tubelet by repetition
            x = x.repeat(1, 1, cfg.tubelet_size, 1, 1)
        x = self.embeddings.patch_embeddings.proj(x.to(self.layernorm.weight.dtype))
        x = x.flatten(2).transpose(1, 2)
        # positions use the configured grid (crop_size / patch_size), as the checkpoints were trained with
        pos = grid_positions(torch.arange(x.shape[1], device=x.device), cfg.grid_size, cfg.grid_size)
        for block in self.layer:
            x = block(x, pos)
        return self.layernorm(x)
