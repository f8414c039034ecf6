"""Cross-entropy-method planning with the AC world model: the statistics, and the in-process reference plan.

Each iteration samples S action sequences from N(mean, std) (translation clipped to +-maxnorm, gripper to
+-0.75, rotation zero, as upstream `mpc_utils.cem`), rolls all S out from the shared context prefix, scores the
final latent's L1 distance to the goal latent, and refits mean/std from the top-k with momentum. The plan is
the final mean (small gripper moves rounded to zero). The served `plan` walk runs the same steps as nodes
(`nodes.py`); `plan_cem` runs them in-process on dense caches, as the reference.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from mstar_vjepa.rollout import check_horizon, prefill_prefix, roll


@attrs.frozen(kw_only=True)
class CEMSettings:
    """Upstream defaults of the `WorldModel` wrapper are 400 samples, top-10, 10 iterations (bounds: `request`)."""

    samples: int = 400
    topk: int = 10
    iterations: int = 10
    momentum_mean: float = 0.25
    momentum_std: float = 0.95
    momentum_mean_gripper: float = 0.15
    momentum_std_gripper: float = 0.15
    maxnorm: float = 0.05
    gripper_limit: float = 0.75


def to_actions(samples: torch.Tensor) -> torch.Tensor:
    """`[..., 4]` (xyz, gripper) -> `[..., 7]` with zero rotation."""
    return torch.cat([samples[..., :3], samples.new_zeros(*samples.shape[:-1], 3), samples[..., 3:]], dim=-1)


def _blend(new: torch.Tensor, old: torch.Tensor, m_xyz: float, m_grip: float) -> torch.Tensor:
    return torch.cat([new[..., :3] * (1 - m_xyz) + old[..., :3] * m_xyz, new[..., 3:] * (1 - m_grip) + old[..., 3:] * m_grip], -1)


def cem_start(horizon: int, cfg: CEMSettings, like: torch.Tensor) -> dict[str, Any]:
    """The statistics before the first iteration (dtype and device of `like`): mean 0, std maxnorm / 1 (gripper).

    `like` is the states: actions meet poses in fp32 pose math, whatever dtype the latents are in.
    """
    std = torch.cat([torch.full((horizon, 3), cfg.maxnorm), torch.ones(horizon, 1)], -1).to(like)
    return {"mean": torch.zeros_like(std), "std": std, "costs": [], "best_cost": float("inf"),
            "best": None}


def cem_sample(stats: dict[str, Any], cfg: CEMSettings, generator: torch.Generator | None) -> torch.Tensor:
    """S clipped samples `[S, H, 4]` from N(mean, std)."""
    mean = stats["mean"]
    noise = torch.randn(cfg.samples, *mean.shape, generator=generator, dtype=mean.dtype).to(mean.device)
    sampled = noise * stats["std"] + mean
    sampled[..., :3] = sampled[..., :3].clamp(-cfg.maxnorm, cfg.maxnorm)
    sampled[..., 3:] = sampled[..., 3:].clamp(-cfg.gripper_limit, cfg.gripper_limit)
    return sampled


def cem_update(stats: dict[str, Any], sampled: torch.Tensor, finals: torch.Tensor, goal: torch.Tensor,
               cfg: CEMSettings) -> dict[str, Any]:
    """Score final latents `[S, P, D]` by L1 to `goal`; refit mean/std from the top-k (a new dict)."""
    cost = (finals.flatten(1) - goal.flatten()[None]).abs().mean(-1)
    top = cost.topk(cfg.topk, largest=False).indices
    best = cost[top[0]].item()
    chosen = sampled[top]
    out = {"mean": _blend(chosen.mean(0), stats["mean"], cfg.momentum_mean, cfg.momentum_mean_gripper),
           "std": _blend(chosen.std(0), stats["std"], cfg.momentum_std, cfg.momentum_std_gripper),
           "costs": [*stats["costs"], best], "best_cost": stats["best_cost"], "best": stats["best"]}
    if best < stats["best_cost"]:
        out.update(best_cost=best, best=to_actions(sampled[top[0]]))
    return out


def cem_plan(cem_stats: dict[str, Any]) -> dict[str, Any]:
    """The plan (final mean, small gripper moves rounded to zero), costs per iteration, best sample."""
    mean = cem_stats["mean"]
    grip = torch.where(mean[:, 3:].abs() < 0.25, torch.zeros_like(mean[:, 3:]), mean[:, 3:])
    return {"plan": to_actions(torch.cat([mean[:, :3], grip], -1)), "costs": torch.tensor(cem_stats["costs"]),
            "best_actions": cem_stats["best"], "best_cost": cem_stats["best_cost"]}


@torch.no_grad()
def plan_cem(predictor, context: torch.Tensor, states: torch.Tensor, goal: torch.Tensor, horizon: int,
             cfg: CEMSettings, generator: torch.Generator | None = None) -> dict[str, Any]:
    """context `[1, C, P, D]`, states `[1, C, 7]`, goal `[P, D]` -> plan, costs per iteration, best sampled plan.

    The context prefix is cached once; each iteration's samples continue from copies of it.
    """
    check_horizon(predictor, context.shape[1], horizon)
    prefix = prefill_prefix(predictor, context, states)
    stats = cem_start(horizon, cfg, states)
    frame, state = context[:, -1].expand(cfg.samples, -1, -1), states[:, -1].expand(cfg.samples, -1)
    for _ in range(cfg.iterations):
        sampled = cem_sample(stats, cfg, generator)
        cache = prefix.copy(cfg.samples)
        latents, _ = roll(predictor, cache, frame, state, to_actions(sampled))
        stats = cem_update(stats, sampled, latents[:, -1], goal, cfg)
    return {**cem_plan(stats), "rollouts": cfg.samples * cfg.iterations}
