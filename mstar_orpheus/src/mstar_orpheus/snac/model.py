"""SNAC decoding: residual codebook lookup (`from_codes`) and the convolutional waveform decoder."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from mstar_orpheus.snac.config import SNACConfig
from mstar_orpheus.snac.layers import Snake, UpsampleBlock, wn_conv1d


class CodebookLevel(nn.Module):
    """One quantizer level: code -> codebook vector -> 1x1 projection to the latent, held `stride` steps."""

    def __init__(self, latent: int, codebook_size: int, codebook_dim: int, stride: int):
        super().__init__()
        self.stride = stride
        self.codebook = nn.Embedding(codebook_size, codebook_dim)
        self.out_proj = wn_conv1d(codebook_dim, latent, kernel_size=1)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        z = self.out_proj(self.codebook(codes).transpose(1, 2))
        return z.repeat_interleave(self.stride, dim=-1)


class ResidualCodebook(nn.Module):
    """Sum of every level's contribution: the quantized latent `[B, latent, T]`."""

    def __init__(self, cfg: SNACConfig):
        super().__init__()
        self.levels = nn.ModuleList(
            CodebookLevel(cfg.latent, cfg.codebook_size, cfg.codebook_dim, s) for s in cfg.vq_strides
        )

    def forward(self, codes: list[torch.Tensor]) -> torch.Tensor:
        if len(codes) != len(self.levels):
            raise ValueError(f"SNAC needs {len(self.levels)} code levels, got {len(codes)}")
        z = 0.0
        for level, c in zip(self.levels, codes, strict=True):
            z = z + level(c)
        return z


class WaveDecoder(nn.Module):
    """Latent -> waveform: input convs, upsampling blocks, Snake, output conv, tanh."""

    def __init__(self, cfg: SNACConfig):
        super().__init__()
        latent, ch = cfg.latent, cfg.decoder_dim
        if cfg.depthwise:
            self.input_depthwise = wn_conv1d(latent, latent, kernel_size=7, padding=3, groups=latent)
            self.input_proj = wn_conv1d(latent, ch, kernel_size=1)
        else:
            self.input_depthwise = None
            self.input_proj = wn_conv1d(latent, ch, kernel_size=7, padding=3)
        blocks = []
        for i, stride in enumerate(cfg.decoder_rates):
            in_dim, out_dim = ch // 2**i, ch // 2 ** (i + 1)
            blocks.append(UpsampleBlock(in_dim, out_dim, stride, cfg.noise, out_dim if cfg.depthwise else 1))
        self.blocks = nn.ModuleList(blocks)
        self.output_act = Snake(out_dim)
        self.output_conv = wn_conv1d(out_dim, 1, kernel_size=7, padding=3)

    def forward(self, z: torch.Tensor, generators: list[torch.Generator] | None = None) -> torch.Tensor:
        if self.input_depthwise is not None:
            z = self.input_depthwise(z)
        x = self.input_proj(z)
        for block in self.blocks:
            x = block(x, generators)
        return torch.tanh(self.output_conv(self.output_act(x)))


class SNACDecoder(nn.Module):
    """The decode half of SNAC: `decode(codes)` == `snac.SNAC.decode(codes)` for the same weights and noise."""

    def __init__(self, cfg: SNACConfig):
        super().__init__()
        self.config = cfg
        self.quantizer = ResidualCodebook(cfg)
        self.decoder = WaveDecoder(cfg)

    def decode(self, codes: list[torch.Tensor], seeds: list[int] | None = None) -> torch.Tensor:
        """Codes per level (`[B, T_level]`) -> audio `[B, 1, samples]`; `seeds` fix each row's noise."""
        generators = None
        if seeds is not None:
            device = codes[0].device
            generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
        return self.decoder(self.quantizer(codes), generators)

    forward = decode

    def fold_weight_norm(self) -> SNACDecoder:
        """Bake g * v / ||v|| into plain weights once, so inference skips recomputing them per call."""
        for module in self.modules():
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
        return self
