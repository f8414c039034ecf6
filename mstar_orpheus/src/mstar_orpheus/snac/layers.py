"""SNAC decoder building blocks: Snake activation, weight-normalised convolutions, noise and residual blocks."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm


def wn_conv1d(*args, **kwargs) -> nn.Module:
    """A Conv1d whose weight is g * v / ||v|| (the checkpoint stores g and v)."""
    return weight_norm(nn.Conv1d(*args, **kwargs))


def wn_conv_transpose1d(*args, **kwargs) -> nn.Module:
    """A ConvTranspose1d with weight normalisation, for upsampling."""
    return weight_norm(nn.ConvTranspose1d(*args, **kwargs))


class Snake(nn.Module):
    """Snake activation x + sin^2(alpha x) / alpha, with a learned alpha per channel."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the epsilon keeps alpha == 0 channels finite, as in the trained checkpoint's convention
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class Noise(nn.Module):
    """Adds per-time-step Gaussian noise scaled by a learned 1x1 projection of the input.

    `generators` (one per batch row) make the noise reproducible per window, so a window decodes to
    the same samples alone or batched with others. Without them the global RNG draws `[B, 1, T]`.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.proj = wn_conv1d(dim, dim, kernel_size=1, bias=False)

    def forward(self, x: torch.Tensor, generators: list[torch.Generator] | None = None) -> torch.Tensor:
        b, _, t = x.shape
        if generators is None:
            noise = torch.randn((b, 1, t), device=x.device, dtype=x.dtype)
        else:
            noise = torch.cat(
                [torch.randn((1, 1, t), generator=g, device=x.device, dtype=x.dtype) for g in generators]
            )
        return x + noise * self.proj(x)


class ResidualUnit(nn.Module):
    """Snake -> dilated (grouped) conv k=7 -> Snake -> 1x1 conv, added to the input."""

    def __init__(self, dim: int, dilation: int, groups: int):
        super().__init__()
        self.act1 = Snake(dim)
        self.conv = wn_conv1d(dim, dim, kernel_size=7, dilation=dilation, padding=3 * dilation, groups=groups)
        self.act2 = Snake(dim)
        self.proj = wn_conv1d(dim, dim, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.act2(self.conv(self.act1(x))))


class UpsampleBlock(nn.Module):
    """Snake -> transposed conv (x stride) -> optional noise -> three residual units (dilations 1, 3, 9)."""

    def __init__(self, in_dim: int, out_dim: int, stride: int, noise: bool, groups: int):
        super().__init__()
        self.act = Snake(in_dim)
        self.upsample = wn_conv_transpose1d(
            in_dim,
            out_dim,
            kernel_size=2 * stride,
            stride=stride,
            padding=math.ceil(stride / 2),
            output_padding=stride % 2,
        )
        self.noise = Noise(out_dim) if noise else None
        self.residuals = nn.ModuleList(ResidualUnit(out_dim, d, groups) for d in (1, 3, 9))

    def forward(self, x: torch.Tensor, generators: list[torch.Generator] | None = None) -> torch.Tensor:
        x = self.upsample(self.act(x))
        if self.noise is not None:
            x = self.noise(x, generators)
        for unit in self.residuals:
            x = unit(x)
        return x
