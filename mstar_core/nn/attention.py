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


class DenseKVCache:
    """One sequence's keys and values per layer in plain tensors: the reference KV cache of dense paths.

    Each forward attends to the cached rows plus its own and, with `write` (the default), stores its own
    for the next. Its own rows see each other causally, or all of them with `bidirectional`; `mask`
    (`[T, Tcached + T]` bool, True = may attend), when set, replaces both for the forwards that follow.
    Nothing is paged or shared: `copy()` is a deep copy (a snapshot of a label).
    """

    def __init__(self, *, write: bool = True, bidirectional: bool = False, mask: torch.Tensor | None = None):
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.write, self.bidirectional, self.mask = write, bidirectional, mask

    def __len__(self) -> int:
        return 0 if not self.k else self.k[0].shape[0]

    def copy(self) -> DenseKVCache:
        out = DenseKVCache(write=self.write, bidirectional=self.bidirectional, mask=self.mask)
        out.k = {i: t.clone() for i, t in self.k.items()}
        out.v = {i: t.clone() for i, t in self.v.items()}
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.k, self.v) for t in d.values())

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        ctx = self.k[layer].shape[0] if layer in self.k else 0
        if ctx:
            k, v = torch.cat([self.k[layer], k]), torch.cat([self.v[layer], v])
        if self.write:
            self.k[layer], self.v[layer] = k, v
        n, mask, causal = q.shape[0], self.mask, False
        if mask is None and not self.bidirectional and n > 1:
            if ctx:  # every cached row, then causal among the new ones
                mask = torch.ones(n, ctx + n, dtype=torch.bool, device=q.device)
                mask[:, ctx:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            else:
                causal = True
        qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))  # 4-D: CPU's flash kernel takes nothing else
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out[0].transpose(0, 1)
