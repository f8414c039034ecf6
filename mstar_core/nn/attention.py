"""The contract between attention layers and the engine that owns their KV cache.

Models run on packed tokens: a step's tokens from every request in the batch are flattened to
one `[T, ...]` tensor. A layer projects q, k, v for those tokens and calls
`context.attend(layer, q, k, v)`; the context (set up by the engine for this step) stores k and
v where they belong (paged KV pool, or nowhere) and returns the attention output. The model
never sees page tables, masks or batch boundaries, so the same module runs dense for a
reference comparison and paged inside the engine.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionContext(Protocol):
    """Per-step attention state: set by the engine, called by each attention layer."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q `[T, Hq, D]`, k and v `[T, Hkv, D]` for this step's tokens -> output `[T, Hq, D]`."""
        ...


class DenseAttention:
    """No cache: one sequence attends to itself (causal by default); the reference for tests.

    `mask` (`[T, T]` bool, True = may attend) overrides causality, e.g. for bidirectional
    blocks or frame-causal masks.
    """

    def __init__(self, causal: bool = True, mask: torch.Tensor | None = None):
        self.causal = causal
        self.mask = mask

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        hq, hkv = q.shape[1], k.shape[1]
        if hq != hkv:
            k = k.repeat_interleave(hq // hkv, dim=1)
            v = v.repeat_interleave(hq // hkv, dim=1)
        qh, kh, vh = (x.transpose(0, 1) for x in (q, k, v))  # [H, T, D]
        if self.mask is not None:
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=self.mask, scale=scale)
        else:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=self.causal, scale=scale)
        return out.transpose(0, 1)
