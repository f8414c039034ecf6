"""AC rollouts: imagine the latents that follow a context clip under a sequence of actions.

History: context latents z_0..z_{C-1} with measured states s_0..s_{C-1}; the actions between context frames are
derived from those states. Step k feeds frame z_{C-1+k} with action u_k and state s_{C-1+k}, takes the predicted
next latent, layer-norms it (no parameters) into z_{C+k}, and integrates s_{C+k} = pose(s_{C-1+k}, u_k).
`Rollout` does one step per call against a frame KV cache; `rollout_reprefill` is the upstream loop that
recomputes the whole growing history at every step (the baseline and the reference for the cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar_vjepa.ac_predictor import ACPredictor
from mstar_vjepa.kv import DenseFrameCache
from mstar_vjepa.pose import compute_new_pose, poses_to_actions


def normalize(z: torch.Tensor) -> torch.Tensor:
    """Parameter-free layer norm over the feature dim (applied to encoder outputs and to each prediction)."""
    return F.layer_norm(z, (z.shape[-1],))


def check_horizon(predictor: ACPredictor, context_frames: int, horizon: int) -> None:
    """The history fed to the predictor (context + horizon - 1 frames) must fit the frame-causal mask."""
    limit = predictor.cfg.max_frames
    if horizon < 1 or context_frames + horizon - 1 > limit:
        raise ValueError(
            f"horizon must be between 1 and {limit - context_frames + 1} for {context_frames} context frame(s) "
            f"(the mask covers {limit} steps), got {horizon}"
        )


def prefill_prefix(predictor: ACPredictor, context: torch.Tensor, states: torch.Tensor, cache=None) -> DenseFrameCache:
    """Cache every context frame but the last (their actions are known from the states), in `cache` if given."""
    if cache is None:
        cache = predictor.new_cache(context.shape[0], context.device, context.dtype)
    if context.shape[1] > 1:
        predictor(context[:, :-1], poses_to_actions(states), states[:, :-1], cache=cache)
    return cache


class Rollout:
    """A batch of rollouts continuing from `cache` (all frames before `frame`); one predictor pass per step."""

    def __init__(self, predictor: ACPredictor, cache, frame: torch.Tensor, state: torch.Tensor):
        self.predictor = predictor
        self.cache = cache
        self.frame = frame  # [B, P, D]: the newest frame, not cached yet
        self.state = state  # [B, 7]: its state

    def step(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply `action [B, 7]`: returns the next latent `[B, P, D]` and the next state `[B, 7]`."""
        out = self.predictor(self.frame[:, None], action[:, None], self.state[:, None], cache=self.cache)
        self.frame = normalize(out[:, -1])
        self.state = compute_new_pose(self.state, action)
        return self.frame, self.state


def step_together(rolls: list[Rollout], actions: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Advance several single-sequence rollouts with equal history in one predictor pass.

    Needs caches that can be viewed as one batch (`batch_of`, e.g. paged ones); otherwise steps them one by one.
    """
    batch_of = getattr(type(rolls[0].cache), "batch_of", None)
    if len(rolls) == 1 or batch_of is None:
        return [r.step(a) for r, a in zip(rolls, actions, strict=True)]
    cache = batch_of([r.cache for r in rolls])
    action = torch.cat(actions)
    frame = torch.cat([r.frame for r in rolls])
    state = torch.cat([r.state for r in rolls])
    out = rolls[0].predictor(frame[:, None], action[:, None], state[:, None], cache=cache)
    frames, states = normalize(out[:, -1]), compute_new_pose(state, action)
    for i, r in enumerate(rolls):
        r.frame, r.state = frames[i : i + 1], states[i : i + 1]
    return [(r.frame, r.state) for r in rolls]


@torch.no_grad()
def rollout_cached(
    predictor: ACPredictor, context: torch.Tensor, states: torch.Tensor, actions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """context `[B, C, P, D]`, states `[B, C, 7]`, actions `[B, H, 7]` -> latents `[B, H, P, D]`, states `[B, H, 7]`."""
    check_horizon(predictor, context.shape[1], actions.shape[1])
    roll = Rollout(predictor, prefill_prefix(predictor, context, states), context[:, -1], states[:, -1])
    outs = [roll.step(actions[:, k]) for k in range(actions.shape[1])]
    return torch.stack([o[0] for o in outs], 1), torch.stack([o[1] for o in outs], 1)


@torch.no_grad()
def rollout_reprefill(
    predictor: ACPredictor, context: torch.Tensor, states: torch.Tensor, actions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's loop: every step runs the predictor over the whole history from scratch."""
    check_horizon(predictor, context.shape[1], actions.shape[1])
    frames, poses = context, states
    acts = poses_to_actions(states)
    latents, out_states = [], []
    for k in range(actions.shape[1]):
        acts = torch.cat([acts, actions[:, k : k + 1]], dim=1)
        z = normalize(predictor(frames, acts, poses)[:, -1])
        s = compute_new_pose(poses[:, -1], actions[:, k])
        frames = torch.cat([frames, z[:, None]], dim=1)
        poses = torch.cat([poses, s[:, None]], dim=1)
        latents.append(z)
        out_states.append(s)
    return torch.stack(latents, 1), torch.stack(out_states, 1)
