"""Mimi's encoder half: 24 kHz audio -> residual-VQ codes (Qwen3-TTS's 12 Hz tokenizer encodes reference audio with it).

A SEANet convolution stack (causal convs, ELU residual blocks, strided downsampling), a causal sliding-window
transformer with LayerNorm, GELU MLP and LayerScale, one more strided conv to the frame rate, then a split
residual VQ: one semantic codebook and the acoustic ones each quantize the same latents (each RVQ with its own
input projection), every stage taking the nearest entry (Euclidean) of what the earlier stages left.

Parameter names are the flat Mimi checkpoint's (`encoder.layers.N.*`, `encoder_transformer.layers.N.*`,
`downsample.conv.*`, `quantizer.{semantic,acoustic}_residual_vector_quantizer.*`); the decoder half is not built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.nn.attention import DenseAttention
from mstar_core.nn.codec_vocoder import LayerScale
from mstar_core.nn.mlp import MLP
from mstar_core.nn.rotary import RotaryEmbedding
from mstar_core.nn.self_attention import GroupedQueryAttention


class MimiEncoderConfig(Protocol):
    """The sizes `MimiEncoder` reads (the model package's validated config)."""

    hidden_size: int
    num_filters: int
    num_residual_layers: int
    upsampling_ratios: Sequence[int]  # the decoder's order: the encoder downsamples by them reversed
    kernel_size: int
    last_kernel_size: int
    residual_kernel_size: int
    dilation_growth_rate: int
    compress: int
    use_conv_shortcut: bool
    pad_mode: str
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    hidden_act: str
    norm_eps: float
    sliding_window: int
    layer_scale_initial_scale: float
    attention_bias: bool
    rope_theta: float
    latent_stride: int  # the last conv's stride: the SEANet rate over the frame rate
    codebook_size: int
    codebook_dim: int
    vector_quantization_hidden_dimension: int
    num_quantizers: int
    num_semantic_quantizers: int


class PaddedConv1d(nn.Module):
    """A causal Conv1d: `kernel - stride` samples of padding on the left, and on the right as many as make the length
    a multiple of the stride (so every input sample reaches some output)."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, dilation: int = 1, bias: bool = True,
                 pad_mode: str = "constant"):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, stride, dilation=dilation, bias=bias)
        self.stride = stride
        self.left = (kernel - 1) * dilation + 1 - stride
        self.pad_mode = pad_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        right = -x.shape[-1] % self.stride
        return self.conv(F.pad(x, (self.left, right), mode=self.pad_mode))


class ResnetBlock(nn.Module):
    """ELU, conv k (dilated) to `dim // compress`, ELU, conv 1 back; plus the input (or a 1x1 conv of it)."""

    def __init__(self, cfg: MimiEncoderConfig, dim: int, dilation: int):
        super().__init__()
        hidden = dim // cfg.compress
        self.block = nn.ModuleList([
            nn.ELU(), PaddedConv1d(dim, hidden, cfg.residual_kernel_size, dilation=dilation, pad_mode=cfg.pad_mode),
            nn.ELU(), PaddedConv1d(hidden, dim, 1, pad_mode=cfg.pad_mode),
        ])
        self.shortcut = PaddedConv1d(dim, dim, 1, pad_mode=cfg.pad_mode) if cfg.use_conv_shortcut else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        for layer in self.block:
            out = layer(out)
        return self.shortcut(x) + out


class SEANetEncoder(nn.Module):
    """`[B, 1, N]` samples -> `[B, hidden, N / prod(ratios)]`: a conv, then per ratio residual blocks and a strided
    conv doubling the width, then ELU and a conv to `hidden_size`. ELUs hold list slots, as in the checkpoint."""

    def __init__(self, cfg: MimiEncoderConfig):
        super().__init__()
        layers: list[nn.Module] = [PaddedConv1d(1, cfg.num_filters, cfg.kernel_size, pad_mode=cfg.pad_mode)]
        width = cfg.num_filters
        for ratio in reversed(list(cfg.upsampling_ratios)):
            layers += [ResnetBlock(cfg, width, cfg.dilation_growth_rate**j) for j in range(cfg.num_residual_layers)]
            layers += [nn.ELU(), PaddedConv1d(width, width * 2, 2 * ratio, stride=ratio, pad_mode=cfg.pad_mode)]
            width *= 2
        layers += [nn.ELU(), PaddedConv1d(width, cfg.hidden_size, cfg.last_kernel_size, pad_mode=cfg.pad_mode)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class EncoderLayer(nn.Module):
    """Pre-LayerNorm attention and GELU MLP, each residual branch scaled per channel (LayerScale)."""

    def __init__(self, cfg: MimiEncoderConfig, i: int):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn = GroupedQueryAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                               cfg.head_dim, i, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=False)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)

    def forward(self, x: torch.Tensor, rope, context) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), rope, context))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class EncoderTransformer(nn.Module):
    """Causal sliding-window attention over one sequence `[T, H]` (each step sees itself and `window - 1` before)."""

    def __init__(self, cfg: MimiEncoderConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, {"rope_type": "default", "rope_theta": cfg.rope_theta})
        self.window = cfg.sliding_window

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        i = torch.arange(x.shape[0], device=x.device)
        mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
        context, rope = DenseAttention(mask=mask), self.rotary_emb(i)
        for layer in self.layers:
            x = layer(x, rope, context)
        return x


class EuclideanCodebook(nn.Module):
    """A k-means codebook kept as running sums (buffers, as the checkpoint's): entry = `embed_sum / cluster_usage`."""

    def __init__(self, size: int, dim: int):
        super().__init__()
        self.register_buffer("cluster_usage", torch.ones(size))
        self.register_buffer("embed_sum", torch.zeros(size, dim))

    def table(self) -> torch.Tensor:
        return self.embed_sum / self.cluster_usage.clamp(min=1e-5)[:, None]

    def nearest(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """`[N, D]` -> the index of each row's nearest entry `[N]` (fp32 Euclidean distances)."""
        return torch.cdist(x[None].float(), table[None].float(), p=2)[0].argmin(dim=-1)


class VectorQuantization(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.codebook = EuclideanCodebook(size, dim)


class ResidualVQ(nn.Module):
    """Stage k quantizes what stages 0..k-1 left; `input_proj` (a 1x1 conv) first when the widths differ."""

    def __init__(self, cfg: MimiEncoderConfig, quantizers: int):
        super().__init__()
        self.input_proj = (nn.Conv1d(cfg.hidden_size, cfg.vector_quantization_hidden_dimension, 1, bias=False)
                           if cfg.vector_quantization_hidden_dimension != cfg.hidden_size else None)
        self.layers = nn.ModuleList(VectorQuantization(cfg.codebook_size, cfg.codebook_dim)
                                    for _ in range(quantizers))

    def encode(self, latents: torch.Tensor, quantizers: int) -> torch.Tensor:
        """`[B, hidden, T]` -> codes `[B, quantizers, T]`."""
        if self.input_proj is not None:
            latents = self.input_proj(latents)
        residual = latents.transpose(1, 2)  # [B, T, D]
        codes = []
        for layer in self.layers[:quantizers]:
            table = layer.codebook.table()
            flat = residual.reshape(-1, residual.shape[-1])
            index = layer.codebook.nearest(flat, table)
            residual = residual - F.embedding(index, table).view_as(residual)
            codes.append(index.view(residual.shape[:-1]))
        return torch.stack(codes, dim=1)


class SplitResidualVQ(nn.Module):
    """The semantic RVQ's codes, then the acoustic RVQ's (on the same latents, not on the semantic residual)."""

    def __init__(self, cfg: MimiEncoderConfig):
        super().__init__()
        self.semantic = cfg.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = ResidualVQ(cfg, cfg.num_semantic_quantizers)
        self.acoustic_residual_vector_quantizer = ResidualVQ(cfg, cfg.num_quantizers - cfg.num_semantic_quantizers)

    def encode(self, latents: torch.Tensor, quantizers: int) -> torch.Tensor:
        codes = self.semantic_residual_vector_quantizer.encode(latents, self.semantic)
        if quantizers > self.semantic:
            acoustic = self.acoustic_residual_vector_quantizer.encode(latents, quantizers - self.semantic)
            codes = torch.cat([codes, acoustic], dim=1)
        return codes


class MimiEncoder(nn.Module):
    """`encode(audio [B, 1, N], quantizers)` -> codes `[B, quantizers, frames]` (fp32)."""

    def __init__(self, cfg: MimiEncoderConfig):
        super().__init__()
        self.config = cfg
        self.encoder = SEANetEncoder(cfg)
        self.encoder_transformer = EncoderTransformer(cfg)
        self.downsample = PaddedConv1d(cfg.hidden_size, cfg.hidden_size, 2 * cfg.latent_stride,
                                       stride=cfg.latent_stride, bias=False, pad_mode="replicate")
        self.quantizer = SplitResidualVQ(cfg)

    def latents(self, audio: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(audio)
        hidden = torch.stack([self.encoder_transformer(h.transpose(0, 1)) for h in hidden]).transpose(1, 2)
        return self.downsample(hidden)

    def encode(self, audio: torch.Tensor, quantizers: int) -> torch.Tensor:
        if not self.config.num_semantic_quantizers <= quantizers <= self.config.num_quantizers:
            raise ValueError(f"quantizers must be in [{self.config.num_semantic_quantizers}, "
                             f"{self.config.num_quantizers}], got {quantizers}")
        return self.quantizer.encode(self.latents(audio), quantizers)
