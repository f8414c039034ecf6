"""Diffusion-time conditioning: sinusoidal features of a float time, then a two-layer SiLU MLP (DiT style)."""

from __future__ import annotations

import math

import torch
from torch import nn


def timestep_features(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """`t` `[N]` -> `[N, dim]` (cosines first, then sines), frequencies geometric from 1 to 1/max_period (fp32)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t.reshape(-1).float()[:, None] * freqs[None]
    out = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
    return out if dim % 2 == 0 else torch.cat([out, torch.zeros_like(out[:, :1])], dim=-1)


class TimestepEmbedder(nn.Module):
    """`mlp.0` (features -> hidden), SiLU, `mlp.2` (hidden -> hidden); names as DiT / BAGEL checkpoints."""

    def __init__(self, hidden: int, frequency_dim: int = 256):
        super().__init__()
        self.frequency_dim = frequency_dim
        self.mlp = nn.Sequential(nn.Linear(frequency_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        feats = timestep_features(t, self.frequency_dim).to(self.mlp[0].weight.dtype)
        return self.mlp(feats)
