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


class CEMRun:
    """One CEM plan as a resumable state machine: `iterate()` runs one iteration (S rollouts in one batch).

    The context prefix is cached once (in `prefix_cache` if given, e.g. a `PagedFrameCache`) and forked for
    every iteration's samples; `free()` drops it (idempotent), so an engine can stop a plan between iterations.
    """

    def __init__(
        self,
        predictor: ACPredictor,
        context: torch.Tensor,
        states: torch.Tensor,
        goal: torch.Tensor,
        horizon: int,
        settings: CEMSettings,
        generator: torch.Generator | None = None,
        share: str = "fork",
        prefix_cache=None,
    ):
        if share not in ("fork", "copy"):
            raise ValueError(f"share must be 'fork' or 'copy', got {share!r}")
        check_horizon(predictor, context.shape[1], horizon)
        self.predictor, self.goal, self.horizon, self.settings = predictor, goal, horizon, settings
        self.generator, self.share = generator, share
        s, dev, dt = settings.samples, context.device, context.dtype
        with torch.no_grad():  # once, shared by every sample and iteration
            self.prefix = prefill_prefix(predictor, context, states, prefix_cache)
        self.mean = torch.zeros(horizon, 4, device=dev, dtype=dt)
        self.std = torch.cat([torch.full((horizon, 3), settings.maxnorm), torch.ones(horizon, 1)], -1).to(dev, dt)
        self.last_frame = context[:, -1].expand(s, -1, -1)
        self.last_state = states[:, -1].expand(s, -1)
        self.costs: list[float] = []
        self.best_cost, self.best = float("inf"), None

    @property
    def done(self) -> bool:
        return len(self.costs) >= self.settings.iterations

    @torch.no_grad()
    def iterate(self) -> None:
        """Sample, roll all samples out on forks (or copies) of the prefix, score, refit mean/std."""
        cfg, s = self.settings, self.settings.samples
        noise = torch.randn(s, self.horizon, 4, generator=self.generator, dtype=self.mean.dtype).to(self.mean.device)
        sampled = noise * self.std + self.mean
        sampled[..., :3] = sampled[..., :3].clamp(-cfg.maxnorm, cfg.maxnorm)
        sampled[..., 3:] = sampled[..., 3:].clamp(-cfg.gripper_limit, cfg.gripper_limit)
        actions = _to_actions(sampled)
        cache = self.prefix.fork(s) if self.share == "fork" else self.prefix.copy(s)
        try:
            roll = Rollout(self.predictor, cache, self.last_frame, self.last_state)
            for k in range(self.horizon):
                final, _ = roll.step(actions[:, k])
        finally:
            getattr(cache, "free", lambda: None)()
        cost = (final.flatten(1) - self.goal.flatten()[None]).abs().mean(-1)
        top = cost.topk(cfg.topk, largest=False).indices
        self.costs.append(cost[top[0]].item())
        if self.costs[-1] < self.best_cost:
            self.best_cost, self.best = self.costs[-1], actions[top[0]]
        chosen = sampled[top]
        self.mean = _blend(chosen.mean(0), self.mean, cfg.momentum_mean, cfg.momentum_mean_gripper)
        self.std = _blend(chosen.std(0), self.std, cfg.momentum_std, cfg.momentum_std_gripper)

    def result(self) -> dict[str, Any]:
        """The plan (final mean, small gripper moves rounded to zero), costs per iteration, best sample."""
        grip = torch.where(self.mean[:, 3:].abs() < 0.25, torch.zeros_like(self.mean[:, 3:]), self.mean[:, 3:])
        return {
            "plan": _to_actions(torch.cat([self.mean[:, :3], grip], -1)),
            "costs": torch.tensor(self.costs),
            "best_actions": self.best,
            "best_cost": self.best_cost,
            "rollouts": self.settings.samples * len(self.costs),
        }

    def free(self) -> None:
        """Drop the prefix cache's pages (a dense prefix is left to the garbage collector)."""
        getattr(self.prefix, "free", lambda: None)()


def pages_needed(context_frames: int, horizon: int, samples: int) -> int:
    """Peak pages of a paged CEM plan: the context prefix (all frames but the last) plus one iteration's rollouts."""
    return context_frames - 1 + samples * horizon


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
    run = CEMRun(predictor, context, states, goal, horizon, settings, generator, share, prefix_cache)
    try:
        while not run.done:
            run.iterate()
    finally:
        run.free()
    return run.result()
