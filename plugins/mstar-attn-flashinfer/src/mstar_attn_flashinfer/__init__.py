"""FlashInfer paged attention on CUDA (install with the `gpu` extra); same contract as the `torch` backend."""

from __future__ import annotations

from typing import Any

from mstar_attn_flashinfer.backend import FlashInferPagedAttention
from mstar_core.plugins import hookimpl

__all__ = ["FlashInferPagedAttention"]


@hookimpl
def mstar_register_attention_backends(register: Any) -> None:
    """Register the `flashinfer` attention backend (it reports itself unavailable without CUDA or flashinfer)."""
    register("flashinfer", FlashInferPagedAttention)
