"""Cross-entropy-method planning with the AC world model, run server-side in one batch per iteration.

Each iteration samples S action sequences from N(mean, std) (translation clipped to +-maxnorm, gripper to
+-0.75, rotation zero, as upstream `mpc_utils.cem`), rolls all S out in one batch whose caches share the
context prefix through `fork`, scores the final latent's L1 distance to the goal latent, and refits mean/std
from the top-k with momentum. The plan is the final mean (small gripper moves rounded to zero).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from mstar_vjepa.ac_predictor import ACPredictor
from mstar_vjepa.rollout import Rollout, check_horizon, prefill_prefix


@attrs.frozen(kw_only=True)
class CEMSettings:
    """Upstream defaults of the `WorldModel` wrapper are 400 samples, top-10, 10 iterations."""

    samples: int = 400
    topk: int = 10
    iterations: int = 10
    momentum_mean: float = 0.25
    momentum_std: float = 0.95
    momentum_mean_gripper: float = 0.15
    momentum_std_gripper: float = 0.15
    maxnorm: float = 0.05
    gripper_limit: float = 0.75

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.topk <= self.samples:
            raise ValueError(f"topk must be between 1 and samples ({self.samples}), got {self.topk}")
        if self.iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {self.iterations}")


def _to_actions(samples: torch.Tensor) -> torch.Tensor:
    """`[..., 4]` (xyz, gripper) -> `[..., 7]` with zero rotation."""
    zeros = samples.new_zeros(*samples.shape[:-1], 3)
    return torch.cat([samples[..., :3], zeros, samples[..., 3:]], dim=-1)


def _blend(new: torch.Tensor, old: torch.Tensor, m_xyz: float, m_grip: float) -> torch.Tensor:
    return torch.cat([new[..., :3] * (1 - m_xyz) + old[..., :3] * m_xyz, new[..., 3:] * (1 - m_grip) + old[..., 3:] * m_grip], -1)


@torch.no_grad()
def plan_cem(
    predictor: ACPredictor,
    context: torch.Tensor,
    states: torch.Tensor,
    goal: torch.Tensor,
    horizon: int,
    settings: CEMSettings,
    generator: torch.Generator | None = None,
    share: str = "fork",
    prefix_cache=None,
) -> dict[str, Any]:
    """context `[1, C, P, D]`, states `[1, C, 7]`, goal `[P, D]` -> plan, costs per iteration, best sampled plan.

    `prefix_cache` (an empty single-sequence cache, e.g. a `PagedFrameCache`) replaces the dense default;
    caches with a `free()` are freed when done.
    """
    if share not in ("fork", "copy"):
        raise ValueError(f"share must be 'fork' or 'copy', got {share!r}")
    check_horizon(predictor, context.shape[1], horizon)
    s, dev, dt = settings.samples, context.device, context.dtype
    prefix = prefill_prefix(predictor, context, states, prefix_cache)  # once, shared by every sample and iteration
    mean = torch.zeros(horizon, 4, device=dev, dtype=dt)
    std = torch.cat([torch.full((horizon, 3), settings.maxnorm), torch.ones(horizon, 1)], -1).to(dev, dt)
    last_frame = context[:, -1].expand(s, -1, -1)
    last_state = states[:, -1].expand(s, -1)
    costs, best_cost, best = [], float("inf"), None
    for _ in range(settings.iterations):
        noise = torch.randn(s, horizon, 4, generator=generator, dtype=dt).to(dev)
        sampled = noise * std + mean
        sampled[..., :3] = sampled[..., :3].clamp(-settings.maxnorm, settings.maxnorm)
        sampled[..., 3:] = sampled[..., 3:].clamp(-settings.gripper_limit, settings.gripper_limit)
        actions = _to_actions(sampled)
        cache = prefix.fork(s) if share == "fork" else prefix.copy(s)
        roll = Rollout(predictor, cache, last_frame, last_state)
        for k in range(horizon):
            final, _ = roll.step(actions[:, k])
        getattr(cache, "free", lambda: None)()
        cost = (final.flatten(1) - goal.flatten()[None]).abs().mean(-1)
        top = cost.topk(settings.topk, largest=False).indices
        costs.append(cost[top[0]].item())
        if costs[-1] < best_cost:
            best_cost, best = costs[-1], actions[top[0]]
        chosen = sampled[top]
        mean = _blend(chosen.mean(0), mean, settings.momentum_mean, settings.momentum_mean_gripper)
        std = _blend(chosen.std(0), std, settings.momentum_std, settings.momentum_std_gripper)
    getattr(prefix, "free", lambda: None)()
    grip = torch.where(mean[:, 3:].abs() < 0.25, torch.zeros_like(mean[:, 3:]), mean[:, 3:])
    plan = _to_actions(torch.cat([mean[:, :3], grip], -1))
    return {
        "plan": plan,
        "costs": torch.tensor(costs),
        "best_actions": best,
        "best_cost": best_cost,
        "rollouts": s * settings.iterations,
    }
