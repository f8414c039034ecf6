"""AC rollouts in-process (the references the served walks are tested against): cached and re-prefill.

History: context latents z_0..z_{C-1} with measured states s_0..s_{C-1}; the actions between context frames are
derived from those states. Step k feeds frame z_{C-1+k} with action u_k and state s_{C-1+k}, takes the predicted
next latent, layer-norms it (no parameters) into z_{C+k}, and integrates s_{C+k} = pose(s_{C-1+k}, u_k).
`rollout_cached` does one predictor pass per step against a dense frame cache; `rollout_reprefill` is upstream's
loop, which recomputes the whole growing history at every step (the benchmark's baseline).
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


def dense(predictor) -> ACPredictor:
    """The upstream-API module of an `ACPredictor` or of its `kvcache` node module (`PagedACPredictor`)."""
    return getattr(predictor, "predictor", predictor)


def check_horizon(predictor, context_frames: int, horizon: int) -> None:
    """The history fed to the predictor (context + horizon - 1 frames) must fit the frame-causal mask."""
    limit = dense(predictor).cfg.max_frames
    if horizon < 1 or context_frames + horizon - 1 > limit:
        raise ValueError(f"horizon must be between 1 and {limit - context_frames + 1} for {context_frames} context "
                         f"frame(s) (the mask covers {limit} steps), got {horizon}")


def prefill_prefix(predictor, context: torch.Tensor, states: torch.Tensor) -> DenseFrameCache:
    """Cache every context frame but the last (their actions are known from the states)."""
    predictor = dense(predictor)
    cache = predictor.new_cache(context.shape[0], context.device, context.dtype)
    if context.shape[1] > 1:
        predictor(context[:, :-1], poses_to_actions(states), states[:, :-1], cache=cache)
    return cache


def roll(predictor, cache, frame: torch.Tensor, state: torch.Tensor, actions: torch.Tensor):
    """Continue B rollouts from `cache` (every frame before `frame [B, P, D]`) -> latents `[B, H, P, D]`, states."""
    latents, states = [], []
    for k in range(actions.shape[1]):
        frame = normalize(dense(predictor)(frame[:, None], actions[:, k : k + 1], state[:, None], cache=cache)[:, -1])
        state = compute_new_pose(state, actions[:, k])
        latents.append(frame)
        states.append(state)
    return torch.stack(latents, 1), torch.stack(states, 1)


@torch.no_grad()
def rollout_cached(predictor, context: torch.Tensor, states: torch.Tensor, actions: torch.Tensor):
    """context `[B, C, P, D]`, states `[B, C, 7]`, actions `[B, H, 7]` -> latents `[B, H, P, D]`, states `[B, H, 7]`."""
    check_horizon(predictor, context.shape[1], actions.shape[1])
    return roll(predictor, prefill_prefix(predictor, context, states), context[:, -1], states[:, -1], actions)


@torch.no_grad()
def rollout_reprefill(predictor, context: torch.Tensor, states: torch.Tensor, actions: torch.Tensor):
    """Upstream's loop: every step runs the predictor over the whole history from scratch."""
    check_horizon(predictor, context.shape[1], actions.shape[1])
    frames, poses, acts = context, states, poses_to_actions(states)
    for k in range(actions.shape[1]):
        acts = torch.cat([acts, actions[:, k : k + 1]], dim=1)
        z = normalize(dense(predictor)(frames, acts, poses)[:, -1])
        frames = torch.cat([frames, z[:, None]], dim=1)
        poses = torch.cat([poses, compute_new_pose(poses[:, -1], actions[:, k])[:, None]], dim=1)
    h = actions.shape[1]
    return frames[:, -h:], poses[:, -h:]
