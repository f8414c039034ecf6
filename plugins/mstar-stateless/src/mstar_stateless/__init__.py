"""The `stateless` engine: batches calls of encoder, decoder, VAE and codec nodes across requests."""

from __future__ import annotations

from typing import Any

from mstar_core.plugins import hookimpl
from mstar_stateless.batching import pad_and_stack, split_outputs
from mstar_stateless.engine import StatelessEngine

__all__ = ["StatelessEngine", "pad_and_stack", "split_outputs"]


@hookimpl
def mstar_register_engines(register: Any) -> None:
    """Register the `stateless` engine kind."""
    register("stateless", StatelessEngine)
