"""UMT5's encoder (`UMT5EncoderModel`'s weights, names as in transformers' `text_encoder/`), batched on `stateless`.

T5 with a relative-position bias in every layer (T5 shares layer 0's): RMS norms without a mean, unscaled
dot-product attention plus the bucketed bias, a gated-GELU (tanh) FFN. Wan pads prompts to
`max_sequence_length` and zeroes the embeddings past each prompt's length (the DiT's cross-attention has no
mask), so a prompt encodes alone, unpadded, and gets zero rows appended: the same as a padded batch with
its keys masked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar_wan.config import TextEncoderConfig


class T5Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps)).to(self.weight.dtype)


def relative_buckets(length: int, num_buckets: int, max_distance: int, device: torch.device) -> torch.Tensor:
    """Bidirectional T5 buckets `[L, L]` of key position minus query position: exact when near, log-spaced when far."""
    rel = torch.arange(length, device=device)[None, :] - torch.arange(length, device=device)[:, None]
    half = num_buckets // 2
    out = (rel > 0).long() * half
    rel = rel.abs()
    exact = half // 2
    far = exact + (torch.log(rel.float() / exact) / math.log(max_distance / exact) * (half - exact)).long()
    return out + torch.where(rel < exact, rel, far.clamp(max=half - 1))


class SelfAttention(nn.Module):
    def __init__(self, cfg: TextEncoderConfig):
        super().__init__()
        inner = cfg.num_heads * cfg.d_kv
        self.heads = cfg.num_heads
        self.q, self.k, self.v = (nn.Linear(cfg.d_model, inner, bias=False) for _ in range(3))
        self.o = nn.Linear(inner, cfg.d_model, bias=False)
        self.relative_attention_bias = nn.Embedding(cfg.relative_attention_num_buckets, cfg.num_heads)

    def forward(self, x: torch.Tensor, buckets: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        q, k, v = (p(x).unflatten(-1, (self.heads, -1)).transpose(1, 2) for p in (self.q, self.k, self.v))
        bias = self.relative_attention_bias(buckets).permute(2, 0, 1)[None].to(q.dtype)  # [1, H, L, L]
        bias = bias.masked_fill(~key_mask[:, None, None, :], torch.finfo(q.dtype).min)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
        return self.o(out.transpose(1, 2).flatten(2))


class GatedFFN(nn.Module):
    def __init__(self, cfg: TextEncoderConfig):
        super().__init__()
        self.wi_0 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wi_1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wo = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.wi_0(x), approximate="tanh") * self.wi_1(x)
        return self.wo(h.to(self.wo.weight.dtype))  # `wo` may be kept in float32 (as transformers keeps it)


class _Sub(nn.Module):
    """One pre-norm residual sublayer, named as T5's `layer.{0,1}`."""

    def __init__(self, cfg: TextEncoderConfig, attention: bool):
        super().__init__()
        if attention:
            self.SelfAttention = SelfAttention(cfg)
        else:
            self.DenseReluDense = GatedFFN(cfg)
        self.layer_norm = T5Norm(cfg.d_model, cfg.layer_norm_epsilon)


class EncoderBlock(nn.Module):
    def __init__(self, cfg: TextEncoderConfig):
        super().__init__()
        self.layer = nn.ModuleList([_Sub(cfg, True), _Sub(cfg, False)])

    def forward(self, x: torch.Tensor, buckets: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        attn, ffn = self.layer
        x = x + attn.SelfAttention(attn.layer_norm(x), buckets, key_mask)
        return x + ffn.DenseReluDense(ffn.layer_norm(x))


class _Stack(nn.Module):
    def __init__(self, cfg: TextEncoderConfig):
        super().__init__()
        self.block = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.num_layers))
        self.final_layer_norm = T5Norm(cfg.d_model, cfg.layer_norm_epsilon)


class UMT5Encoder(nn.Module):
    """`forward(input_ids [B, L], key_mask [B, L] bool) -> [B, L, d_model]`."""

    def __init__(self, cfg: TextEncoderConfig):
        super().__init__()
        self.config = cfg
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder = _Stack(cfg)

    def forward(self, input_ids: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        buckets = relative_buckets(input_ids.shape[1], cfg.relative_attention_num_buckets,
                                   cfg.relative_attention_max_distance, input_ids.device)
        x = self.shared(input_ids)
        for block in self.encoder.block:
            x = block(x, buckets, key_mask)
        return self.encoder.final_layer_norm(x)


class TextEncoderNode(nn.Module):
    """The `text_encoder` node: prompts' token ids -> `[max_sequence_length, d_model]`, zero past each prompt.

    Batches itself (`forward_batch`): prompts of different lengths pad to the longest with their keys masked.
    """

    def __init__(self, encoder: UMT5Encoder, max_sequence_length: int):
        super().__init__()
        self.encoder = encoder
        self.max_sequence_length = max_sequence_length

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.forward_batch([{"input_ids": input_ids}])[0]

    def forward_batch(self, calls: Sequence[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
        ids = [torch.as_tensor(c["input_ids"]).reshape(-1)[: self.max_sequence_length] for c in calls]
        longest = max(1, *(len(i) for i in ids))
        device = self.encoder.shared.weight.device
        batch = torch.zeros(len(ids), longest, dtype=torch.long, device=device)
        mask = torch.zeros(len(ids), longest, dtype=torch.bool, device=device)
        for row, i in enumerate(ids):
            batch[row, : len(i)] = i.to(device)
            mask[row, : len(i)] = True
        hidden = self.encoder(batch, mask)
        out = []
        for row, i in enumerate(ids):
            context = hidden.new_zeros(self.max_sequence_length, hidden.shape[-1])
            context[: len(i)] = hidden[row, : len(i)]
            out.append({"context": context})
        return out
