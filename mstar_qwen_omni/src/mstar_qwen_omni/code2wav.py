"""Code2Wav: 16 codes per 80 ms frame -> 1920 samples at 24 kHz (fp32, causal, no cache between windows).

Codes of all quantizers are embedded in one table with per-quantizer offsets and averaged; a causal
sliding-window transformer (layer scale, RoPE) refines them; two ConvTranspose + ConvNeXt stages
upsample, then a causal conv, SnakeBeta residual blocks with transposed-conv upsampling, SnakeBeta and a
final conv give the waveform, clamped to [-1, 1]. Streaming decodes windows of `chunk` new frames with up
to `left` frames of context and drops the context's samples (`decode_window`), which is what
transformers' `chunked_decode` does offline. Names are the checkpoint's (`code2wav.*`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.nn.attention import DenseAttention
from mstar_core.nn.mlp import GatedMLP
from mstar_core.nn.norm import RMSNorm
from mstar_core.nn.rotary import RotaryEmbedding
from mstar_core.nn.self_attention import GroupedQueryAttention
from mstar_qwen_omni.config import Code2WavConfig


class CausalConv1d(nn.Module):
    """Conv1d padded on the left only (stride 1 here, so the length is kept)."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.pad = (kernel - 1) * dilation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (self.pad, 0)))


class CausalConvTranspose1d(nn.Module):
    """ConvTranspose1d trimmed by `kernel - stride` samples on each side: `stride` times the length."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.trim = kernel - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y[..., self.trim : y.shape[-1] - self.trim]


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.dwconv(x).transpose(1, 2))
        h = self.gamma * self.pwconv2(F.gelu(self.pwconv1(h)))
        return x + h.transpose(1, 2)


class SnakeBeta(nn.Module):
    """`x + sin^2(x * e^alpha) / (e^beta + 1e-9)` per channel."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.exp()[None, :, None]
        beta = self.beta.exp()[None, :, None]
        if torch.is_grad_enabled():
            return x + (1.0 / (beta + 1e-9)) * torch.sin(x * alpha).pow(2)
        # the same ops in the same order, in place on one buffer: a window's activations are megabytes, and four
        # fresh ones a call cost as much as the arithmetic (bitwise the expression above)
        out = x * alpha
        return out.sin_().square_().mul_(1.0 / (beta + 1e-9)).add_(x)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class DecoderBlock(nn.Module):
    def __init__(self, cfg: Code2WavConfig, i: int):
        super().__init__()
        cin, cout, rate = cfg.decoder_dim // 2**i, cfg.decoder_dim // 2 ** (i + 1), cfg.upsample_rates[i]
        self.block = nn.ModuleList([SnakeBeta(cin), CausalConvTranspose1d(cin, cout, 2 * rate, rate),
                                    *(ResidualUnit(cout, d) for d in (1, 3, 9))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.block:
            x = layer(x)
        return x


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class TransformerLayer(nn.Module):
    def __init__(self, cfg: Code2WavConfig, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GroupedQueryAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                               cfg.head_dim, i, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)

    def forward(self, x, rope, context) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), rope, context))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class PreTransformer(nn.Module):
    def __init__(self, cfg: Code2WavConfig):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, {"rope_type": "default", "rope_theta": cfg.rope_theta})
        self.window = cfg.sliding_window

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `[T, H]` -> `[T, H]`: causal, each frame sees itself and the `window - 1` before it."""
        t = x.shape[0]
        i = torch.arange(t, device=x.device)
        mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
        context = DenseAttention(mask=mask)
        rope = self.rotary_emb(i)
        for layer in self.layers:
            x = layer(x, rope, context)
        return self.norm(x)


class Code2Wav(nn.Module):
    """`forward(codes [B, Q, T])` -> waveform `[B, 1, T * samples_per_frame]` in [-1, 1]."""

    def __init__(self, cfg: Code2WavConfig):
        super().__init__()
        self.config = cfg
        self.samples_per_frame = cfg.samples_per_frame
        self.pre_transformer = PreTransformer(cfg)
        self.code_embedding = nn.Embedding(cfg.codebook_size * cfg.num_quantizers, cfg.hidden_size)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalConvTranspose1d(cfg.hidden_size, cfg.hidden_size, f, f), ConvNeXtBlock(cfg.hidden_size)])
            for f in cfg.upsampling_ratios
        )
        out_dim = cfg.decoder_dim // 2 ** len(cfg.upsample_rates)
        self.decoder = nn.ModuleList([
            CausalConv1d(cfg.hidden_size, cfg.decoder_dim, 7),
            *(DecoderBlock(cfg, i) for i in range(len(cfg.upsample_rates))),
            SnakeBeta(out_dim),
            CausalConv1d(out_dim, 1, 7),
        ])

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if codes.dim() != 3 or codes.shape[1] != cfg.num_quantizers:
            raise ValueError(f"codes must be [batch, {cfg.num_quantizers}, frames], got {list(codes.shape)}")
        offsets = torch.arange(cfg.num_quantizers, device=codes.device).view(1, -1, 1) * cfg.codebook_size
        hidden = self.code_embedding(codes + offsets).mean(1)  # [B, T, H]
        hidden = torch.stack([self.pre_transformer(h) for h in hidden]).transpose(1, 2)
        for stage in self.upsample:
            for layer in stage:
                hidden = layer(hidden)
        for layer in self.decoder:
            hidden = layer(hidden)
        return hidden.clamp(-1, 1)

    def decode_window(self, codes: torch.Tensor, context: int) -> torch.Tensor:
        """Decode `[B, Q, context + new]` frames and keep only the new frames' samples `[B, 1, new * spf]`."""
        return self(codes)[..., context * self.samples_per_frame :]

    def chunked_decode(self, codes: torch.Tensor, chunk: int = 25, left: int = 25) -> torch.Tensor:
        """Offline decode in windows of `chunk` new frames with up to `left` frames of context (the streamed result)."""
        out, start, total = [], 0, codes.shape[-1]
        while start < total:
            end = min(start + chunk, total)
            context = min(left, start)
            out.append(self.decode_window(codes[..., start - context : end], context))
            start = end
        return torch.cat(out, dim=-1)
