"""What the `diffusion` engine calls on a DiT node's module, and the check that runs when the engine is built."""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import torch

from mstar_core.errors import ModuleContractError
from mstar_core.runtime.contract import check_method, keyword_call


class DenoiserModule(Protocol):
    """A velocity model (a DiT): noisy latents and their timesteps in, a velocity per latent out.

    The engine stacks one row per request and guidance branch: `x` `[B, *latent_shape]`, `t` `[B]`
    (float32: each row's sigma times the node's `timestep_scale`), and each conditioning input
    (every node input the engine does not read itself) stacked to `[B, ...]` by name. Returns `[B,
    *latent_shape]`, the velocity pointing from data to noise (`x_t = (1 - sigma) x_0 + sigma
    noise` gives `v = noise - x_0`).
    """

    def forward(self, x: torch.Tensor, t: torch.Tensor, /, **cond: torch.Tensor) -> torch.Tensor: ...


def denoiser_call(cond: tuple[str, ...], optional_cond: tuple[str, ...]) -> inspect.Signature:
    """The engine's call: `x` and `t` by position, the conditioning by name (optional ones only when sent)."""
    positional = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY) for name in ("x", "t")]
    return inspect.Signature(positional + list(keyword_call(cond, optional_cond).parameters.values()))


def check_denoiser_module(module: Any, node: Any, cond: tuple[str, ...], optional_cond: tuple[str, ...]) -> None:
    """Raise `ModuleContractError` unless `module` can take the engine's `DenoiserModule` call for `node`."""
    if module is None or not callable(module):
        raise ModuleContractError(
            f"node '{node.name}' (engine 'diffusion'): a step node either has a denoiser module, called as "
            f"module(x, t, {', '.join(cond + optional_cond) or '...'}) -> velocity, or none and an input "
            f"'velocity' that another node computes; got {type(module).__name__}",
            node=node.name, engine="diffusion",
        )
    check_method(module, "forward", denoiser_call(cond, optional_cond), node=node.name, engine="diffusion",
                 why="it computes each row's velocity")
