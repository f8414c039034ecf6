"""`function`-engine node modules: the encoders, and the glue of the rollout and plan walks around the predictor."""

from __future__ import annotations

from typing import Any

import torch

from mstar_vjepa.ac_predictor import COND_TOKENS, ACPredictor
from mstar_vjepa.encoder import VJEPA2Encoder
from mstar_vjepa.planner import CEMSettings, cem_sample, cem_start, cem_update, to_actions
from mstar_vjepa.pose import compute_new_pose, poses_to_actions
from mstar_vjepa.predictor import VJEPA2Model
from mstar_vjepa.rollout import normalize

PREFIX_LABEL = "context"  # a plan's context prefix
SAMPLE_LABEL = "sample{}"  # CEM sample i's cache label (a fork of PREFIX_LABEL)


class VideoEncoderNode:
    """`video [T, C, H, W]` -> `latents [N, hidden]` (HF encoder); same-shaped videos run as one batch."""

    def __init__(self, model: VJEPA2Model):
        self.model = model

    @torch.no_grad()
    def forward_batch(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        videos = torch.stack([b["video"] for b in batch])
        return [{"latents": z} for z in self.model.encode(videos)]

    def __call__(self, video: torch.Tensor) -> dict[str, Any]:
        return self.forward_batch([{"video": video}])[0]


class MaskedPredictorNode:
    """`latents [N, hidden]` (+ optional `context_mask`/`target_mask` index lists) -> `predicted [K, hidden]`."""

    def __init__(self, model: VJEPA2Model):
        self.model = model

    @torch.no_grad()
    def __call__(self, latents: torch.Tensor, context_mask=None, target_mask=None) -> dict[str, Any]:
        ctx = None if context_mask is None else [context_mask[None]]
        tgt = None if target_mask is None else [target_mask[None]]
        return {"predicted": self.model.predict(latents[None], ctx, tgt)[0]}


class FrameEncoderNode:
    """AC encoding: each frame `[C, H, W]` becomes a 2-frame tubelet -> `[P, D]`, then a parameter-free norm."""

    def __init__(self, encoder: VJEPA2Encoder):
        self.encoder = encoder

    @torch.no_grad()
    def forward_batch(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        frames = [b["frames"] for b in batch]
        counts = [f.shape[0] for f in frames]
        clips = torch.cat(frames).unsqueeze(1).expand(-1, self.encoder.cfg.tubelet_size, -1, -1, -1)
        latents = normalize(self.encoder(clips)).split(counts)
        return [{"latents": z} for z in latents]

    def __call__(self, frames: torch.Tensor) -> dict[str, Any]:
        return self.forward_batch([{"frames": frames}])[0]


class StepTokensNode:
    """One call of the predictor node: step 0 feeds the context frames not cached yet, step k the last prediction.

    Returns the call's tokens (`step_embeds`), positions, the rows to return (the newest frame's patches), the
    state after action k, and a plan sample's label to drop after its last step (the next iteration forks anew).
    """

    def __init__(self, predictor: ACPredictor):
        self.predictor = predictor

    @torch.no_grad()
    def __call__(self, context, states, actions, step, horizon, latent=None, state=None,
                 sample=None) -> dict[str, Any]:
        acts = actions if sample is None else actions[sample]
        if step == 0:  # the frames before the first action: their actions follow from the states
            cached = 0 if sample is None else context.shape[0] - 1  # a sample forks all frames but the last
            frames, first, now = context[cached:], cached, states[-1]
            feed = torch.cat([poses_to_actions(states)[cached:], acts[:1]]), states[cached:]
        else:
            frames, first, now = latent[None], context.shape[0] - 1 + step, state
            feed = acts[step : step + 1], state[None]
        drop = SAMPLE_LABEL.format(sample) if sample is not None and step == horizon - 1 else None
        return {**frame_call(self.predictor, frames, *feed, first), "state": compute_new_pose(now, acts[step]),
                "drop_label": drop}


def frame_call(predictor: ACPredictor, frames, actions, states, first: int, name: str = "step") -> dict[str, Any]:
    """Tokens `[n * (2 + P), dim]` of n frames from step `first` on, their positions, the last frame's patch rows."""
    n, tps = frames.shape[0], predictor.tokens_per_step
    return {f"{name}_embeds": predictor.embed_frames(frames, actions, states),
            f"{name}_positions": predictor.frame_positions(first, n, frames.device),
            f"{name}_rows": torch.arange((n - 1) * tps + COND_TOKENS, n * tps, device=frames.device)}


class PlanStartNode:
    """CEM set-up: the statistics, the random stream, and the context prefix call (all frames but the last)."""

    def __init__(self, predictor: ACPredictor):
        self.predictor = predictor

    @torch.no_grad()
    def __call__(self, context, states, horizon, cem, seed) -> dict[str, Any]:
        cached = context.shape[0] - 1
        prefix = dict.fromkeys(("prefix_embeds", "prefix_positions", "prefix_rows"))
        if cached:  # C = 1: nothing to share, each sample starts from the only frame
            prefix = frame_call(self.predictor, context[:cached], poses_to_actions(states), states[:cached], 0, "prefix")
        return {"cem_stats": cem_start(horizon, CEMSettings(**cem), states),
                "cem_rng": torch.Generator().manual_seed(int(seed)).get_state(),
                "prefix_calls": int(cached > 0), "prefix_label": PREFIX_LABEL if cached else None, **prefix}


def sample_node(cem_stats, cem, cem_rng) -> dict[str, Any]:
    """This iteration's S action sequences (the random stream continues from `cem_rng`)."""
    gen = torch.Generator()
    gen.set_state(cem_rng)
    sampled = cem_sample(cem_stats, CEMSettings(**cem), gen)
    return {"sampled": sampled, "actions": to_actions(sampled), "cem_rng": gen.get_state()}


def update_node(cem_stats, cem, sampled, finals, goal_latents) -> dict[str, Any]:
    """Elites and the refit mean/std, from the samples' final latents."""
    return {"cem_stats": cem_update(cem_stats, sampled, torch.stack(finals), goal_latents[-1], CEMSettings(**cem))}
