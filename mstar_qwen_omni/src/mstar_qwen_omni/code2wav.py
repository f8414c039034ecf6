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
from torch import nn

from mstar_core.nn.codec_vocoder import (
    CausalConv1d,
    CausalConvTranspose1d,
    ConvNeXtBlock,
    DecoderBlock,
    PreTransformer,
    SnakeBeta,
)
from mstar_qwen_omni.config import Code2WavConfig

__all__ = ["Code2Wav", "SnakeBeta"]  # SnakeBeta: its shared home's name, kept importable from here


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
            *(DecoderBlock(cfg.decoder_dim, cfg.upsample_rates, i) for i in range(len(cfg.upsample_rates))),
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

    @property
    def device(self) -> torch.device:
        return self.code_embedding.weight.device

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
