"""Node modules: batch-aware callables for the `function` engine, and the planner module of the `vjepa_cem` engine."""

from __future__ import annotations

from typing import Any

import torch

from mstar_vjepa.ac_predictor import ACPredictor
from mstar_vjepa.encoder import VJEPA2Encoder
from mstar_vjepa.planner import CEMSettings, plan_cem
from mstar_vjepa.predictor import VJEPA2Model
from mstar_vjepa.rollout import normalize


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


class PlannerNode:
    """Server-side CEM: context latents, states, goal latent -> plan `[H, 7]`, per-iteration costs, best sample."""

    def __init__(self, predictor: ACPredictor):
        self.predictor = predictor

    def __call__(self, context, states, goal_latents, horizon, cem, seed) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(int(seed))
        out = plan_cem(self.predictor, context[None], states[None], goal_latents[-1], int(horizon), CEMSettings(**cem), gen)
        return {k: out[k] for k in ("plan", "costs", "best_actions", "best_cost")}
