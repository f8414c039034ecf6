"""The `diffusion` engine: flow-matching denoising loops batched across requests step by step."""

from __future__ import annotations

from typing import Any

from mstar_core.plugins import hookimpl
from mstar_diffusion.contract import DenoiserModule
from mstar_diffusion.engine import DiffusionEngine
from mstar_diffusion.guidance import RENORM_MODES, Guidance, combine
from mstar_diffusion.schedules import SCHEDULES, register_schedule, shift_sigmas

__all__ = [
    "RENORM_MODES",
    "SCHEDULES",
    "DenoiserModule",
    "DiffusionEngine",
    "Guidance",
    "combine",
    "register_schedule",
    "shift_sigmas",
]


@hookimpl
def mstar_register_engines(register: Any) -> None:
    """Register the `diffusion` engine kind."""
    register("diffusion", DiffusionEngine)
