"""Grouped-query self-attention over packed tokens, bound to the engine's `AttentionContext`."""

from __future__ import annotations

import torch
from torch import nn

from mstar_core.nn.attention import AttentionContext
from mstar_core.nn.fused import fuse_on_load
from mstar_core.nn.norm import RMSNorm
from mstar_core.nn.rotary import apply_rotary_


class GroupedQueryAttention(nn.Module):
    """Projects q/k/v, applies optional per-head qk-norm and RoPE, lets the context attend, projects out.

    q, k and v are one linear (`qkv_proj`, rows q then k then v); `state_dict()` and
    `load_state_dict()` speak HF Llama/Qwen checkpoint names (`q_proj`, `k_proj`, `v_proj`,
    `o_proj`, `q_norm`, `k_norm`), see `mstar_core.nn.fused`. The layer never sees the KV cache:
    `context.attend(layer_idx, ...)` does.
    """

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_idx: int,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_idx = layer_idx
        self.scale = head_dim**-0.5
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        fuse_on_load(self, "qkv_proj", [("q_proj", self.q_size), ("k_proj", self.kv_size), ("v_proj", self.kv_size)])
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        context: AttentionContext,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`x` `[T, hidden]`, `rope` = `(cos, sin)` for these tokens' positions -> `[T, hidden]`.

        With `rows` (indices into T) only those rows come out, `[len(rows), hidden]`: every token's keys and values
        still reach the cache, the output projection runs over the rows asked for alone."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is None and rope is not None:
            # q and k side by side are one [T, heads + kv heads, D] view: one rotary call for both (the same
            # per-element math, half the ops a layer), in place (qkv is this call's own output)
            qk = apply_rotary_(qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim), *rope)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        else:
            q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            if rope is not None:  # (here q and k are the qk-norm's fresh outputs: rotated in place)
                q, k = apply_rotary_(q, *rope), apply_rotary_(k, *rope)
        out = context.attend(self.layer_idx, q, k, v, self.scale).reshape(t, self.num_heads * self.head_dim)
        return self.o_proj(out if rows is None else out[rows])
