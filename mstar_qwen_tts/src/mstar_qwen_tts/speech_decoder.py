"""The 12 Hz speech tokenizer's decoder: 16 codes per 80 ms frame -> 1920 samples at 24 kHz (fp32, causal).

Codes are embedded by a split residual VQ (one semantic codebook, 15 acoustic ones, each with its own output
projection, summed), a causal conv lifts them to the latent width, a sliding-window transformer with input and
output projections refines them, and Qwen3-Omni's vocoder stack (`mstar_core.nn.codec_vocoder`) makes the waveform;
the transposed convolutions here trim their excess at the end only. Streaming decodes windows of new frames with
left context and drops the context's samples (`decode_window`), as the upstream `chunked_decode` does offline; a voice
cloned in context lends its reference codes as the first windows' left context (`ClonedWindowDecoder`).
Names are the checkpoint's (`speech_tokenizer/model.safetensors`, `decoder.*`).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.nn.codec_vocoder import CausalConv1d, CodecWaveDecoder, PreTransformer, WindowDecoder
from mstar_core.streaming import Chunk
from mstar_qwen_tts.config import SpeechDecoderConfig


class Codebook(nn.Module):
    """A k-means codebook kept as running sums: entry = `embedding_sum / cluster_usage`."""

    def __init__(self, size: int, dim: int):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        table = self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None]
        return F.embedding(codes, table)


class CodebookLayer(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self._codebook = Codebook(size, dim)


class ResidualVQ(nn.Module):
    """Codebooks summed, then a 1x1 conv to the output width (`input_proj` is the encoder's side, kept for loading)."""

    def __init__(self, quantizers: int, size: int, dim: int, io_dim: int):
        super().__init__()
        self.input_proj = nn.Conv1d(io_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, io_dim, 1, bias=False)
        self.vq = nn.Module()
        self.vq.layers = nn.ModuleList(CodebookLayer(size, dim) for _ in range(quantizers))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """`[B, Q, T]` -> `[B, io_dim, T]`."""
        total = sum(layer._codebook.decode(codes[:, q]) for q, layer in enumerate(self.vq.layers))
        return self.output_proj(total.transpose(1, 2))


class SplitResidualVQ(nn.Module):
    def __init__(self, cfg: SpeechDecoderConfig):
        super().__init__()
        dim = cfg.codebook_dim // 2
        self.rvq_first = ResidualVQ(1, cfg.codebook_size, dim, cfg.codebook_dim)
        self.rvq_rest = ResidualVQ(cfg.num_quantizers - 1, cfg.codebook_size, dim, cfg.codebook_dim)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.rvq_first.decode(codes[:, :1]) + self.rvq_rest.decode(codes[:, 1:])


class ProjectedTransformer(PreTransformer):
    """The shared sliding-window transformer between a latent -> hidden and a hidden -> latent projection."""

    def __init__(self, cfg: SpeechDecoderConfig):
        super().__init__(cfg)
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_proj(super().forward(self.input_proj(x)))


class SpeechDecoder(CodecWaveDecoder):
    """The shared codec decoder over the split RVQ's sum, lifted to the latent width by a causal conv; unlike
    Omni's, the transformer has latent projections and the transposed convolutions trim at the end only."""

    offline_chunk = 300  # the upstream tokenizer's window
    quantizer: SplitResidualVQ
    pre_conv: CausalConv1d

    def __init__(self, cfg: SpeechDecoderConfig):
        super().__init__(cfg, {
            "quantizer": SplitResidualVQ(cfg),
            "pre_conv": CausalConv1d(cfg.codebook_dim, cfg.latent_dim, 3),
            "pre_transformer": ProjectedTransformer(cfg),
        }, width=cfg.latent_dim, trim_start=False)

    def frames(self, codes: torch.Tensor) -> torch.Tensor:
        return self.pre_conv(self.quantizer.decode(codes)).transpose(1, 2)  # [B, T, latent]


class ClonedWindowDecoder(WindowDecoder):
    """`WindowDecoder` for the speech of a voice cloned in context (`ref_codes` `[T, G]` in the request): the upstream
    package decodes the reference codes followed by the new ones and cuts the reference's share of the waveform, so
    the first frames are decoded after the reference's. Here a window short of `left` frames of context (the
    stream's start) takes the reference's last frames as the context it lacks; without `ref_codes` it is
    `WindowDecoder`."""

    def __init__(self, codec: nn.Module, left: int):
        super().__init__(codec)
        self.left = left

    def forward(self, codes: Chunk, ref_codes: torch.Tensor | None = None) -> torch.Tensor:
        return self.forward_batch([{"codes": codes, "ref_codes": ref_codes}])[0]["audio"]

    def forward_batch(self, calls: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
        return super().forward_batch([{"codes": self._after_reference(call["codes"], call.get("ref_codes"))}
                                      for call in calls])

    def _after_reference(self, chunk: Chunk, ref_codes: torch.Tensor | None) -> Chunk:
        lacking = self.left - chunk.num_context
        if ref_codes is None or lacking <= 0 or len(ref_codes) == 0:
            return chunk
        tail = tuple(ref_codes[-lacking:])  # frames [G], as the stream's items
        return attrs.evolve(chunk, items=(*tail, *chunk.items), start=chunk.start - len(tail),
                            num_context=chunk.num_context + len(tail))
