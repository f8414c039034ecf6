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

from mstar_core.nn.codec_vocoder import CodecWaveDecoder, PreTransformer, SnakeBeta
from mstar_qwen_omni.config import Code2WavConfig

__all__ = ["Code2Wav", "SnakeBeta"]  # SnakeBeta: its shared home's name, kept importable from here


class Code2Wav(CodecWaveDecoder):
    """The shared codec decoder over the mean of the codes' embeddings (one table, per-quantizer offsets); its
    transposed convolutions trim at both ends."""

    code_embedding: nn.Embedding

    def __init__(self, cfg: Code2WavConfig):
        super().__init__(cfg, {
            "pre_transformer": PreTransformer(cfg),
            "code_embedding": nn.Embedding(cfg.codebook_size * cfg.num_quantizers, cfg.hidden_size),
        }, width=cfg.hidden_size, trim_start=True)

    def frames(self, codes: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        offsets = torch.arange(cfg.num_quantizers, device=codes.device).view(1, -1, 1) * cfg.codebook_size
        return self.code_embedding(codes + offsets).mean(1)  # [B, T, H]
