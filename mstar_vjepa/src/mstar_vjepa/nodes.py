"""Node modules (batch-aware callables for the `function` engine) and the per-request AC rollout engine."""

from __future__ import annotations

from typing import Any

import torch

from mstar_core.runtime.engine import Engine, Invocation, Result
from mstar_vjepa.ac_predictor import ACPredictor
from mstar_vjepa.encoder import VJEPA2Encoder
from mstar_vjepa.planner import CEMSettings, plan_cem
from mstar_vjepa.predictor import VJEPA2Model
from mstar_vjepa.rollout import Rollout, normalize, prefill_prefix, step_together


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


class ACRolloutEngine(Engine):
    """Kind `vjepa_ac`: one frame KV cache per request; call k of the rollout loop runs only frame k's tokens.

    Loop index 0 caches the context frames (all but the last, whose action is the first requested one) and
    predicts step 0; every later call feeds the previous prediction with the next action. `release` drops the
    request's cache.
    """

    kind = "vjepa_ac"

    def __init__(self, node, module: ACPredictor, context):
        super().__init__(node, module, context)
        self.queue: list[Invocation] = []
        self.rollouts: dict[str, Rollout] = {}
        self.largest_batch = 0  # most requests advanced by one predictor pass so far (stats, tests)
        self.pool = None
        if context.settings.get("paged", True):
            try:  # back the caches with the paged KV pool when the kvcache plugin is installed
                from mstar_vjepa.paged import frame_pool
            except ImportError:
                frame_pool = None
            if frame_pool is not None:
                pages = int(context.settings.get("num_pages", 8 * module.cfg.max_frames))
                self.pool = frame_pool(module, pages)

    def _new_cache(self):
        if self.pool is None:
            return None
        from mstar_vjepa.paged import PagedFrameCache

        return PagedFrameCache(self.pool, 1)

    def _drop(self, request_id: str) -> None:
        roll = self.rollouts.pop(request_id, None)
        if roll is not None:
            getattr(roll.cache, "free", lambda: None)()

    def add(self, invocation: Invocation) -> None:
        self.queue.append(invocation)

    def has_work(self) -> bool:
        return bool(self.queue)

    def _start(self, inv: Invocation) -> None:
        """Loop index 0: cache the context frames (all but the last) for this request."""
        ctx, states = inv.inputs["context"][None], inv.inputs["states"][None]
        self._drop(inv.request_id)
        cache = prefill_prefix(self.module, ctx, states, self._new_cache())
        self.rollouts[inv.request_id] = Rollout(self.module, cache, ctx[:, -1], states[:, -1])

    @torch.no_grad()
    def step(self) -> list[Result]:
        batch, self.queue = self.queue, []
        results: list[Result] = []
        ready: dict[int, list[Invocation]] = {}
        for inv in batch:
            try:
                if int(inv.inputs["loop_index"]) == 0:
                    self._start(inv)
                if inv.request_id not in self.rollouts:
                    raise RuntimeError(f"request {inv.request_id} has no rollout cache; the loop must start at index 0")
                ready.setdefault(self.rollouts[inv.request_id].cache.num_frames, []).append(inv)
            except Exception as exc:  # one bad request must not fail the others
                self._drop(inv.request_id)
                results.append((inv, exc))
        # requests at the same history length share one predictor pass (continuous batching of rollouts)
        for group in ready.values():
            rolls = [self.rollouts[inv.request_id] for inv in group]
            self.largest_batch = max(self.largest_batch, len(group))
            actions = [inv.inputs["actions"][int(inv.inputs["loop_index"])][None] for inv in group]
            try:
                outs = step_together(rolls, actions)
            except Exception as exc:
                for inv in group:
                    self._drop(inv.request_id)
                    results.append((inv, exc))
                continue
            for inv, (latent, state) in zip(group, outs, strict=True):
                if int(inv.inputs["loop_index"]) == inv.inputs["actions"].shape[0] - 1:
                    self._drop(inv.request_id)  # last step: the cache is no longer needed
                results.append((inv, {"latent": latent[0], "state": state[0]}))
        return results

    def release(self, request_id: str) -> None:
        self.queue = [inv for inv in self.queue if inv.request_id != request_id]
        self._drop(request_id)

    def active_requests(self) -> set[str]:
        return {inv.request_id for inv in self.queue} | set(self.rollouts)

    def stats(self) -> dict[str, float]:
        out = {"rollout_caches": float(len(self.rollouts)), "rollout_largest_batch": float(self.largest_batch)}
        if self.pool is not None:
            out["kv_pages_used"] = float(self.pool.num_used)
            out["kv_pages_total"] = float(self.pool.num_pages)
        return out

    def close(self) -> None:
        for rid in list(self.rollouts):
            self._drop(rid)
