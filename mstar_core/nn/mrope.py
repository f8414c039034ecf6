"""Multimodal RoPE (M-RoPE): three position axes (time, height, width) sharing one head's frequencies.

Each rotary frequency is driven by one axis. Qwen2-VL gives each axis a contiguous block of frequencies
(`mrope_section` sizes, in order t, h, w); Qwen3-VL / Qwen3-Omni interleave them (`interleaved=True`):
frequency j belongs to h when j % 3 == 1 and j < 3 * sections[1], to w when j % 3 == 2 and
j < 3 * sections[2], else to t. Text tokens carry the same position on all three axes, so for them
M-RoPE equals 1-D RoPE. The output is the half-split `(cos, sin)` layout `apply_rotary` takes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def mrope_axis_of_frequency(sections: Sequence[int], interleaved: bool = True) -> torch.Tensor:
    """`[sum(sections)]` long: which position axis (0 t, 1 h, 2 w) drives each rotary frequency."""
    half = sum(sections)
    with torch.device("cpu"):  # a real table even when the model is built under torch.device("meta")
        if interleaved:
            axis = torch.zeros(half, dtype=torch.long)
            for a in (1, 2):
                axis[a : 3 * sections[a] : 3] = a
            return axis
        return torch.repeat_interleave(torch.arange(len(sections)), torch.tensor(list(sections)))


class MultimodalRotaryEmbedding(nn.Module):
    """Maps `[3, T]` (or `[T]`: text) positions to `(cos, sin)` `[T, head_dim]` with per-axis frequencies."""

    def __init__(self, head_dim: int, sections: Sequence[int], theta: float = 10000.0, interleaved: bool = True):
        super().__init__()
        if 2 * sum(sections) != head_dim:
            raise ValueError(f"mrope sections {list(sections)} must add up to head_dim / 2 = {head_dim // 2}")
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        # plain attributes: derived from the config, never read from a checkpoint
        self.inv_freq = 1.0 / (theta**exponents)
        self.axis = mrope_axis_of_frequency(sections, interleaved)
        self.sections, self.interleaved = tuple(sections), interleaved

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(3, -1)
        inv_freq = self.inv_freq.to(positions.device)
        # the position each frequency reads: axis[j]'s row, per token -> [T, half]
        pos = positions.float().t().gather(1, self.axis.to(positions.device).unsqueeze(0).expand(positions.shape[1], -1))
        freqs = pos * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def extra_repr(self) -> str:
        return f"sections={list(self.sections)}, interleaved={self.interleaved}"
