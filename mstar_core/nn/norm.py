"""Normalization layers: RMSNorm (Llama/Qwen) and a LayerNorm that can drop its affine parameters."""

from __future__ import annotations

import torch
from torch import nn

from mstar_core.nn import cpu_elementwise


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in fp32 and cast back (as the reference does)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = cpu_elementwise.rms_norm(x, self.weight, self.eps)  # one pass on CPU, the same roundings
        if fused is not None:
            return fused
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_forward(self, delta: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(residual + delta, norm(residual + delta))`, the sum possibly written into `delta` (the caller's scratch)."""
        fused = cpu_elementwise.add_rms_norm_(delta, residual, self.weight, self.eps)  # one pass on CPU, the same roundings
        if fused is not None:
            return delta, fused
        total = residual + delta
        return total, self(total)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` that computes in fp32 so bf16 activations keep their statistics exact."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        out = nn.functional.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps)
        return out.to(x.dtype)
