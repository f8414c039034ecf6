"""Noise schedules: the sigmas a denoising loop walks from noise (sigma 1) to data (sigma 0).

A schedule maps `(num_steps, shift)` to `num_steps + 1` sigmas, descending, the last one 0. Step
`i` evaluates the velocity at `sigmas[i]` and moves the latents by `(sigmas[i+1] - sigmas[i]) * v`.
Sigmas are float32 values (computed in float64, rounded once), so every request with the same
settings gets bit-identical steps whatever else is in the batch.

Three flow-matching schedules ship, both with the timestep shift `s' = shift*s / (1 + (shift-1)*s)`:

- `flow_euler`: `linspace(1, 0, N+1)` shifted. BAGEL's (`num_timesteps - 1` steps, shift 3) and
  pi0.5's (shift 1: t = 1, 0.9, ..., dt = -0.1).
- `unipc_flow`: what diffusers' `UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=...)` walks (Wan):
  `linspace(1, 1/T, N+1)[:-1]` shifted, the first sigma just under 1, a terminal 0 (pair it with `solver="unipc"`).
- `diffusers_flow_match_euler`: what `diffusers`' `FlowMatchEulerDiscreteScheduler(shift=...)`
  walks (SD3, FLUX without dynamic shifting): N sigmas from 1 down to the shifted
  `1 / num_train_timesteps`, shifted (again), then a terminal 0.

Others are added with `register_schedule(name, fn)`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import torch

from mstar_core.errors import RegistryLookupError


class Schedule(Protocol):
    """`(num_steps, shift) -> sigmas`: a float64 tensor of num_steps + 1 values, descending, ending at 0."""

    def __call__(self, num_steps: int, shift: float, /) -> torch.Tensor: ...


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """The flow-matching timestep shift: more of the steps spent at high noise when shift > 1."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flow_euler(num_steps: int, shift: float, /) -> torch.Tensor:
    """Uniform sigmas from 1 to 0 in `num_steps` steps, shifted (BAGEL, pi0.5)."""
    return shift_sigmas(torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64), shift)


def diffusers_flow_match_euler(num_steps: int, shift: float, /, num_train_timesteps: int = 1000) -> torch.Tensor:
    """The sigmas of diffusers' FlowMatchEulerDiscreteScheduler (static shift), terminal 0 appended.

    Its smallest sigma is the training grid's smallest (1/T) after the shift, computed in float32 as
    the scheduler does when it is built; `set_timesteps` then spaces N values from 1 down to it and
    applies the shift once more.
    """
    lowest = shift_sigmas(torch.tensor(1.0 / num_train_timesteps, dtype=torch.float32), shift).item()
    sigmas = shift_sigmas(torch.linspace(1.0, lowest, num_steps, dtype=torch.float64), shift)
    return torch.cat([sigmas, torch.zeros(1, dtype=torch.float64)])


def unipc_flow(num_steps: int, shift: float, /, num_train_timesteps: int = 1000) -> torch.Tensor:
    """The sigmas of diffusers' UniPCMultistepScheduler with flow sigmas (Wan): N values spaced from 1 down to 1/T,
    shifted, the first nudged just under 1 (the solver takes log(1 - sigma)), then a terminal 0."""
    sigmas = shift_sigmas(torch.linspace(1.0, 1.0 / num_train_timesteps, num_steps + 1, dtype=torch.float64)[:-1], shift)
    if abs(sigmas[0].item() - 1.0) < 1e-6:
        sigmas[0] -= 1e-6
    return torch.cat([sigmas, torch.zeros(1, dtype=torch.float64)])


SCHEDULES: dict[str, Callable[..., torch.Tensor]] = {
    "flow_euler": flow_euler,
    "diffusers_flow_match_euler": diffusers_flow_match_euler,
    "unipc_flow": unipc_flow,
}


def register_schedule(name: str, schedule: Schedule) -> None:
    """Make `schedule` available to diffusion nodes as option `schedule=name`."""
    if name in SCHEDULES and SCHEDULES[name] is not schedule:
        raise ValueError(f"schedule '{name}' is already registered")
    SCHEDULES[name] = schedule


def get_schedule(name: str) -> Callable[..., torch.Tensor]:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise RegistryLookupError(f"unknown schedule '{name}'; known: {', '.join(sorted(SCHEDULES))}") from None


class SigmaTable:
    """Sigmas per (schedule, num_steps, shift), shared by every request (a small LRU, not per-request state).

    `get` gives the float32 table the updates use; `exact` the float64 one the schedule computed (an integer
    timestep is truncated from it, as the reference schedulers do before rounding to float32)."""

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self._tables: OrderedDict[tuple[str, int, float], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def get(self, schedule: str, num_steps: int, shift: float) -> torch.Tensor:
        return self._pair(schedule, num_steps, shift)[0]

    def exact(self, schedule: str, num_steps: int, shift: float) -> torch.Tensor:
        return self._pair(schedule, num_steps, shift)[1]

    def _pair(self, schedule: str, num_steps: int, shift: float) -> tuple[torch.Tensor, torch.Tensor]:
        key = (schedule, num_steps, shift)
        table = self._tables.get(key)
        if table is None:
            sigmas = get_schedule(schedule)(num_steps, shift)
            if sigmas.shape != (num_steps + 1,):
                raise ValueError(f"schedule '{schedule}' returned {tuple(sigmas.shape)} sigmas for {num_steps} steps; "
                                 f"it must return num_steps + 1")
            table = (sigmas.to(torch.float32), sigmas.to(torch.float64))
            self._tables[key] = table
            if len(self._tables) > self.capacity:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(key)
        return table
