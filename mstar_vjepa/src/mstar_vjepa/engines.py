"""Engines of the AC world model: per-request rollouts (`vjepa_ac`) and server-side CEM plans (`vjepa_cem`).

Both keep frame KV caches in a paged pool (`mstar_kvcache.PagePool`, one page per time step) when the kvcache
plugin is installed, dense caches otherwise. Work that opens caches is admitted first-in first-out against the
pool: a request's whole peak page need is reserved before it starts, so a started rollout never runs out of
pages and the engine never crashes or deadlocks on memory pressure. A request that does not fit now waits
until pages free up; one that needs more pages than the whole pool fails with a 413 naming what to change.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from mstar_core.errors import RequestError
from mstar_core.runtime.engine import Engine, Invocation, Result
from mstar_vjepa.ac_predictor import ACPredictor
from mstar_vjepa.planner import CEMRun, CEMSettings, pages_needed
from mstar_vjepa.rollout import Rollout, prefill_prefix, step_together


def _frame_pool(predictor: ACPredictor, settings) -> Any:
    """The engine's own paged pool, or None (dense caches) when disabled or `mstar_kvcache` is missing."""
    if not settings.get("paged", True):
        return None
    try:
        from mstar_vjepa.paged import frame_pool
    except ImportError:
        return None
    return frame_pool(predictor, int(settings.get("num_pages", 8 * predictor.cfg.max_frames)))


class _PagedAdmission(Engine):
    """Queues, FIFO page reservations and failures shared by both engines; subclasses say what a start needs."""

    def __init__(self, node, module, context, predictor: ACPredictor):
        super().__init__(node, module, context)
        self.predictor = predictor
        self.pool = _frame_pool(predictor, context.settings)
        self.queue: list[Invocation] = []  # admitted (or needing no pages), run by the next step
        self.waiting: deque[Invocation] = deque()  # starts whose pages are not free yet, oldest first
        self.failed: list[Result] = []
        self.reserved: dict[str, int] = {}  # request -> pages set aside for its peak need

    def _starts(self, inv: Invocation) -> bool:
        """Whether `inv` opens the request's caches (and so needs a reservation)."""
        raise NotImplementedError

    def _need(self, inv: Invocation) -> tuple[int, str]:
        """Peak pages `inv`'s request holds at once, and what the request could shrink to need fewer."""
        raise NotImplementedError

    def _new_cache(self):
        if self.pool is None:
            return None
        from mstar_vjepa.paged import PagedFrameCache

        return PagedFrameCache(self.pool, 1)

    def _fits(self, need: int) -> bool:
        return sum(self.reserved.values()) + need <= self.pool.num_pages

    def add(self, invocation: Invocation) -> None:
        if self.pool is None or not self._starts(invocation):
            self.queue.append(invocation)
            return
        try:
            need, shrink = self._need(invocation)
        except Exception as exc:  # malformed inputs fail this request only
            self.failed.append((invocation, exc))
            return
        if need > self.pool.num_pages:
            self.failed.append((invocation, RequestError(
                f"node '{self.node.name}': request {invocation.request_id} needs {need} KV pages at once but the "
                f"pool has {self.pool.num_pages}; {shrink}, or raise the node's num_pages setting", status=413)))
            return
        self.waiting.append(invocation)

    def _admit(self) -> None:
        """Move waiting starts whose pages fit into the queue, strictly in arrival order (no overtaking)."""
        while self.waiting:
            inv = self.waiting[0]
            need, _ = self._need(inv)
            if not self._fits(need):
                return
            self.waiting.popleft()
            self.reserved[inv.request_id] = need
            self.queue.append(inv)

    def _head_fits(self) -> bool:
        return bool(self.waiting) and self._fits(self._need(self.waiting[0])[0])

    def has_work(self) -> bool:
        return bool(self.failed or self.queue) or self._head_fits()

    def _take(self) -> tuple[list[Result], list[Invocation]]:
        """This step's failures and runnable invocations."""
        self._admit()
        results, self.failed = self.failed, []
        batch, self.queue = self.queue, []
        return results, batch

    def _drop(self, request_id: str) -> None:
        """Free the request's caches and its reservation."""
        self.reserved.pop(request_id, None)

    def release(self, request_id: str) -> None:
        self.queue = [inv for inv in self.queue if inv.request_id != request_id]
        self.waiting = deque(inv for inv in self.waiting if inv.request_id != request_id)
        self.failed = [r for r in self.failed if r[0].request_id != request_id]
        self._drop(request_id)

    def active_requests(self) -> set[str]:
        invs = self.queue + list(self.waiting) + [r[0] for r in self.failed]
        return {inv.request_id for inv in invs} | set(self.reserved)

    def stats(self) -> dict[str, float]:
        out = {"waiting_for_pages": float(len(self.waiting))}
        if self.pool is not None:
            out.update(kv_pages_used=float(self.pool.num_used), kv_pages_total=float(self.pool.num_pages),
                       kv_pages_reserved=float(sum(self.reserved.values())))
        return out

    def close(self) -> None:
        for rid in self.active_requests():
            self.release(rid)


class ACRolloutEngine(_PagedAdmission):
    """Kind `vjepa_ac`: one frame KV cache per request; call k of the rollout loop runs only frame k's tokens.

    Loop index 0 caches the context frames (all but the last, whose action is the first requested one) and
    predicts step 0; every later call feeds the previous prediction with the next action. Requests at the same
    history length share one predictor pass. The last step, or `release`, drops the request's cache.
    """

    kind = "vjepa_ac"

    def __init__(self, node, module: ACPredictor, context):
        super().__init__(node, module, context, module)
        self.rollouts: dict[str, Rollout] = {}
        self.largest_batch = 0  # most requests advanced by one predictor pass so far (stats, tests)

    def _starts(self, inv: Invocation) -> bool:
        return int(inv.inputs["loop_index"]) == 0

    def _need(self, inv: Invocation) -> tuple[int, str]:
        # context frames but the last are cached up front; each of the H steps caches the frame it feeds
        return inv.inputs["context"].shape[0] - 1 + inv.inputs["actions"].shape[0], "send fewer actions or frames"

    def _free_cache(self, request_id: str) -> None:
        roll = self.rollouts.pop(request_id, None)
        if roll is not None:
            getattr(roll.cache, "free", lambda: None)()

    def _drop(self, request_id: str) -> None:
        self._free_cache(request_id)
        super()._drop(request_id)

    def _start(self, inv: Invocation) -> None:
        """Loop index 0: cache the context frames (all but the last) for this request."""
        ctx, states = inv.inputs["context"][None], inv.inputs["states"][None]
        self._free_cache(inv.request_id)
        cache = prefill_prefix(self.module, ctx, states, self._new_cache())
        self.rollouts[inv.request_id] = Rollout(self.module, cache, ctx[:, -1], states[:, -1])

    @torch.no_grad()
    def step(self) -> list[Result]:
        results, batch = self._take()
        ready: dict[int, list[Invocation]] = {}
        for inv in batch:
            try:
                if self._starts(inv):
                    self._start(inv)
                if inv.request_id not in self.rollouts:
                    raise RuntimeError(f"request {inv.request_id} has no rollout cache; the loop must start at index 0")
                ready.setdefault(self.rollouts[inv.request_id].cache.num_frames, []).append(inv)
            except Exception as exc:  # one bad request must not fail the others
                self._drop(inv.request_id)
                results.append((inv, exc))
        for group in ready.values():  # equal history length: one predictor pass (continuous batching)
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
                    self._drop(inv.request_id)  # last step: the cache and its reservation are no longer needed
                results.append((inv, {"latent": latent[0], "state": state[0]}))
        return results

    def active_requests(self) -> set[str]:
        return super().active_requests() | set(self.rollouts)

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "rollout_caches": float(len(self.rollouts)),
                "rollout_largest_batch": float(self.largest_batch)}


class CEMPlanEngine(_PagedAdmission):
    """Kind `vjepa_cem`: server-side CEM; each step runs one iteration of every admitted plan.

    A plan caches its context prefix once, then every iteration rolls its S samples out in one batch on forks
    of the prefix's pages (refcounted, never copied) and frees them before the next. Plans stay in the engine
    across steps, so `release` (cancel) can stop one between iterations and free its pages.
    """

    kind = "vjepa_cem"

    def __init__(self, node, module, context):
        super().__init__(node, module, context, module.predictor)
        self.runs: dict[str, tuple[Invocation, CEMRun]] = {}

    def _starts(self, inv: Invocation) -> bool:
        return True

    def _need(self, inv: Invocation) -> tuple[int, str]:
        need = pages_needed(inv.inputs["context"].shape[0], int(inv.inputs["horizon"]), inv.inputs["cem"]["samples"])
        return need, "lower 'samples' or 'horizon'"

    def _drop(self, request_id: str) -> None:
        entry = self.runs.pop(request_id, None)
        if entry is not None:
            entry[1].free()
        super()._drop(request_id)

    def has_work(self) -> bool:
        return bool(self.runs) or super().has_work()

    def _start(self, inv: Invocation) -> None:
        x = inv.inputs
        gen = torch.Generator().manual_seed(int(x["seed"]))
        run = CEMRun(self.predictor, x["context"][None], x["states"][None], x["goal_latents"][-1], int(x["horizon"]),
                     CEMSettings(**x["cem"]), gen, prefix_cache=self._new_cache())
        self.runs[inv.request_id] = (inv, run)

    def step(self) -> list[Result]:
        results, batch = self._take()
        for inv in batch:
            try:
                self._start(inv)
            except Exception as exc:
                self._drop(inv.request_id)
                results.append((inv, exc))
        for rid, (inv, run) in list(self.runs.items()):
            try:
                run.iterate()
            except Exception as exc:
                self._drop(rid)
                results.append((inv, exc))
                continue
            if run.done:
                out = run.result()
                self._drop(rid)
                results.append((inv, {k: out[k] for k in ("plan", "costs", "best_actions", "best_cost")}))
        return results

    def active_requests(self) -> set[str]:
        return super().active_requests() | set(self.runs)

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "plans_running": float(len(self.runs))}
