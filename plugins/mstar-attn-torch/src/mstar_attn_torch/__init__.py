"""Pure-torch paged attention (CPU and CUDA): `scaled_dot_product_attention` over page tables."""

from __future__ import annotations

from typing import Any

from mstar_attn_torch.backend import TorchPagedAttention, TorchPagedContext
from mstar_core.plugins import hookimpl

__all__ = ["TorchPagedAttention", "TorchPagedContext"]


@hookimpl
def mstar_register_attention_backends(register: Any) -> None:
    """Register the `torch` attention backend."""
    register("torch", TorchPagedAttention)
