"""Cross-attention over packed tokens: a decoder layer's queries over an encoder's keys and values.

The keys and values come from the encoder's output once per request (`CrossAttention.project_kv`, which a module's
`cross_kv` stacks over its layers); the engine keeps them (the kvcache engine: in pool pages of a read-only cross
label) and the layer asks `context.cross_attend(layer, q, scale)` for the result, as self-attention asks
`context.attend`. `DenseCrossContext` is the uncached reference: one sequence, its encoder output at hand.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class CrossAttentionContext(Protocol):
    """What a step's attention context offers a cross-attending layer (beside `attend`)."""

    def cross_attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q `[T, Hq, D]` -> `[T, Hq, D]`: each row over all of its sequence's encoder keys."""
        ...


class CrossAttention(nn.Module):
    """q from the decoder's rows, k and v from the encoder's output (HF names: q_proj, k_proj, v_proj, out_proj)."""

    def __init__(self, hidden: int, num_heads: int, layer_idx: int, *, k_bias: bool = False, bias: bool = True):
        super().__init__()
        self.num_heads, self.head_dim, self.layer_idx = num_heads, hidden // num_heads, layer_idx
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(hidden, hidden, bias=bias)
        self.k_proj = nn.Linear(hidden, hidden, bias=k_bias)
        self.v_proj = nn.Linear(hidden, hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)

    def project_kv(self, states: torch.Tensor) -> torch.Tensor:
        """Encoder output `[..., F, hidden]` -> `[..., 2, F, heads, head_dim]` (keys then values)."""
        shape = (*states.shape[:-1], self.num_heads, self.head_dim)
        return torch.stack((self.k_proj(states).view(shape), self.v_proj(states).view(shape)), dim=-4)

    def forward(self, x: torch.Tensor, context: CrossAttentionContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        out = context.cross_attend(self.layer_idx, q, self.scale)
        return self.out_proj(out.reshape(t, -1))


class DenseCrossContext:
    """The reference: one sequence's self-attention (`inner`, e.g. a `DenseKVCache`) and its encoder keys and values
    per layer (`kv`: `[layers, 2, F, heads, head_dim]`, as `cross_kv` gives for one request)."""

    def __init__(self, inner: object, kv: torch.Tensor):
        self.inner, self.kv = inner, kv

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return self.inner.attend(layer, q, k, v, scale)

    def cross_attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        k, v = self.kv[layer, 0].transpose(0, 1), self.kv[layer, 1].transpose(0, 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], scale=scale)
        return out[0].transpose(0, 1)
