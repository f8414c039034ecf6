"""The FLUX.1 autoencoder (BAGEL's VAE): conv encoder to a diagonal Gaussian, conv decoder back to pixels.

Names are those of FLUX's `ae.safetensors`: `encoder.{conv_in, down.L.block.B.*, down.L.downsample.conv,
mid.{block_1, attn_1, block_2}, norm_out, conv_out}` and `decoder.{conv_in, mid.*, up.L.block.B.*,
up.L.upsample.conv, norm_out, conv_out}` (`up.L` is level L, the deepest last). Attention's q/k/v/proj_out
are 1x1 convolutions. Latents are `scale * (mean - shift)`: the posterior's mean, so encoding is
deterministic (sampling it would make a served edit depend on hidden noise).
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


@attrs.frozen(kw_only=True)
class FluxVAEConfig:
    in_channels: int = config_field(3, minimum=1)
    out_ch: int = config_field(3, minimum=1)
    ch: int = config_field(128, minimum=1)
    ch_mult: tuple[int, ...] = attrs.field(default=(1, 2, 4, 4), converter=tuple)
    num_res_blocks: int = config_field(2, minimum=1)
    z_channels: int = config_field(16, minimum=1)
    scale_factor: float = 0.3611
    shift_factor: float = 0.1159
    norm_groups: int = config_field(32, minimum=1)

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any] | None, where: str = "", *, file: str = "config.json") -> FluxVAEConfig:
        """Sizes from section `where` of `file` (absent: FLUX.1's); M* defines this section, so unknown keys fail."""
        out = read_fields(cls, cfg, where, file=file, strict=True)
        widths = [out.ch * m for m in (1, *out.ch_mult)]
        if any(w % out.norm_groups for w in widths):
            raise ConfigError(f"{file}: key '{dotted(where, 'norm_groups')}': every width {widths} must be a multiple "
                              f"of norm_groups ({out.norm_groups})")
        return out


def _norm(cfg: FluxVAEConfig, channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(cfg.norm_groups, channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, cfg: FluxVAEConfig, cin: int, cout: int):
        super().__init__()
        self.norm1 = _norm(cfg, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = _norm(cfg, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all positions, 1x1-conv projections."""

    def __init__(self, cfg: FluxVAEConfig, channels: int):
        super().__init__()
        self.norm = _norm(cfg, channels)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(channels, channels, 1) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        n = self.norm(x)
        # contiguous rows: on CPU a transposed view sends SDPA to its quadratic-memory math path (8x slower at 128x128)
        q, k, v = (f(n).reshape(b, 1, c, h * w).transpose(-1, -2).contiguous() for f in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v).transpose(-1, -2).reshape(b, c, h, w)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))  # asymmetric padding, as the reference


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def _mid(cfg: FluxVAEConfig, channels: int) -> nn.Module:
    mid = nn.Module()
    mid.block_1 = ResnetBlock(cfg, channels, channels)
    mid.attn_1 = AttnBlock(cfg, channels)
    mid.block_2 = ResnetBlock(cfg, channels, channels)
    return mid


class Encoder(nn.Module):
    def __init__(self, cfg: FluxVAEConfig):
        super().__init__()
        self.conv_in = nn.Conv2d(cfg.in_channels, cfg.ch, 3, padding=1)
        mults = (1, *cfg.ch_mult)
        self.down = nn.ModuleList()
        width = cfg.ch
        for level, mult in enumerate(cfg.ch_mult):
            stage = nn.Module()
            cin, width = cfg.ch * mults[level], cfg.ch * mult
            stage.block = nn.ModuleList(ResnetBlock(cfg, cin if i == 0 else width, width) for i in range(cfg.num_res_blocks))
            if level != len(cfg.ch_mult) - 1:
                stage.downsample = Downsample(width)
            self.down.append(stage)
        self.mid = _mid(cfg, width)
        self.norm_out = _norm(cfg, width)
        self.conv_out = nn.Conv2d(width, 2 * cfg.z_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for stage in self.down:
            for block in stage.block:
                h = block(h)
            if hasattr(stage, "downsample"):
                h = stage.downsample(h)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, cfg: FluxVAEConfig):
        super().__init__()
        width = cfg.ch * cfg.ch_mult[-1]
        self.conv_in = nn.Conv2d(cfg.z_channels, width, 3, padding=1)
        self.mid = _mid(cfg, width)
        stages = []
        for level in reversed(range(len(cfg.ch_mult))):
            stage = nn.Module()
            out = cfg.ch * cfg.ch_mult[level]
            stage.block = nn.ModuleList(ResnetBlock(cfg, width if i == 0 else out, out) for i in range(cfg.num_res_blocks + 1))
            width = out
            if level != 0:
                stage.upsample = Upsample(out)
            stages.insert(0, stage)
        self.up = nn.ModuleList(stages)
        self.norm_out = _norm(cfg, width)
        self.conv_out = nn.Conv2d(width, cfg.out_ch, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(self.conv_in(z))))
        for stage in reversed(self.up):
            for block in stage.block:
                h = block(h)
            if hasattr(stage, "upsample"):
                h = stage.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class FluxAutoEncoder(nn.Module):
    """Pixels `[B, 3, H, W]` in [-1, 1] <-> scaled latents `[B, z, H/d, W/d]` (d = 2^(levels-1))."""

    def __init__(self, cfg: FluxVAEConfig):
        super().__init__()
        self.config = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        moments = self.encoder(pixels.to(self.encoder.conv_in.weight.dtype))
        mean = moments[:, : self.config.z_channels]
        return self.config.scale_factor * (mean - self.config.shift_factor)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        z = latents.to(self.decoder.conv_in.weight.dtype) / self.config.scale_factor + self.config.shift_factor
        return self.decoder(z)
