"""Step caching (TeaCache-style): skip every block of a DiT on steps where its input barely moved.

Opt in per node with the engine setting `step_cache_threshold` (a number >= 0; absent: off). At each step the
DiT embeds its rows and computes the first block's modulated input (the cheap *indicator*: the normed hidden
states, shifted and scaled by the timestep's modulation). The relative L1 change of the indicator since the
previous step is added to a running sum, the request's; while the sum stays below the threshold, every row
of the request reuses the residual all the blocks added at its last computed step (`h + residual`) and no
block runs. Once the sum reaches the threshold the request's rows run every block, keep the new residuals, and
the sum starts again from 0. The first step (nothing cached) and the last one (its output is the video) always
compute.

One decision per request and step, taken on one row: the indicator is computed for the request's first row
in the forward (its conditional branch), and its unconditional rows follow that decision, each reusing its own
residual. Classifier-free guidance amplifies `cond - uncond` by its scale, so a step that mixed a fresh
branch with a stale one would amplify the staleness; both stale by the same step keep the difference
consistent.

With threshold 0 nothing is ever reused (the comparison is strict) and the computed path is the module's own
forward in stages, so the result is bit for bit the uncached one.

The state is the request's, per CFG branch: the step node outputs it as `step_cache` and takes it back on the
next call (the walk's `Loop` carries the name), so the engine still keeps nothing per request. Each branch's
state is a dict of tensors: `residual` (what the blocks added), and on the deciding row `indicator` (the last
step's) and `accumulated` (the running sum, a 0-d tensor).

A module opts in by meeting `StepCacheableDenoiser`: its forward split into `cache_embed`, `cache_indicator`,
`cache_blocks` and `cache_head`, with a context that selects rows.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

State = dict[str, torch.Tensor]


class StepCacheableDenoiser(Protocol):
    def cache_embed(self, x: torch.Tensor, t: torch.Tensor, /, **cond: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """`(hidden states [B, L, D], a context with .select(rows))`."""

    def cache_indicator(self, h: torch.Tensor, ctx: Any, /) -> torch.Tensor:
        """What the first block sees of `h` (its modulated input), per row: cheap next to a block."""

    def cache_blocks(self, h: torch.Tensor, ctx: Any, /) -> torch.Tensor: ...

    def cache_head(self, h: torch.Tensor, ctx: Any, /) -> torch.Tensor: ...


METHODS = ("cache_embed", "cache_indicator", "cache_blocks", "cache_head")


def supports_step_cache(module: Any) -> bool:
    return all(callable(getattr(module, name, None)) for name in METHODS)


def relative_l1(now: torch.Tensor, before: torch.Tensor) -> float:
    return float((now.float() - before.float()).abs().mean() / before.float().abs().mean().clamp_min(1e-12))


def cached_forward(module: Any, x: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor],
                   states: list[State | None], threshold: float, requests: list[Any], force: list[bool]
                   ) -> tuple[torch.Tensor, list[State], int]:
    """The velocity of every row, each row's new state, and how many rows reused their residual.

    `requests[i]`: which request row `i` belongs to (its rows share one decision, taken on its first row here);
    `force[i]`: the row must compute (its request's last step)."""
    h, ctx = module.cache_embed(x, t, **cond)
    leader: dict[Any, int] = {}
    for i, request in enumerate(requests):
        leader.setdefault(request, i)
    leaders = sorted(leader.values())
    picked = torch.tensor(leaders, device=h.device)
    indicators = module.cache_indicator(h.index_select(0, picked), ctx.select(picked))
    new_states: list[Any] = [None] * len(states)
    reuse_request: dict[Any, bool] = {}
    for j, i in enumerate(leaders):
        request, state, now = requests[i], states[i], indicators[j]
        members = [k for k, r in enumerate(requests) if r == request]
        cached = all(states[k] is not None and states[k].get("residual") is not None
                     and states[k]["residual"].shape == h[k].shape for k in members)
        seen = state is not None and state.get("indicator") is not None and state["indicator"].shape == now.shape
        total = float(state["accumulated"]) + relative_l1(now, state["indicator"]) if seen else 0.0
        reuse = cached and seen and not any(force[k] for k in members) and total < threshold
        reuse_request[request] = reuse
        # the deciding row carries the indicator and the sum; a computed step starts the sum again
        new_states[i] = {"indicator": now, "accumulated": torch.tensor(total if reuse else 0.0)}
    compute = [i for i, r in enumerate(requests) if not reuse_request[r]]
    out = h
    if compute:
        everything = len(compute) == len(requests)
        rows = torch.tensor(compute, device=h.device)
        subset = h if everything else h.index_select(0, rows)
        after = module.cache_blocks(subset, ctx if everything else ctx.select(rows))
        out = after if everything else h.clone().index_copy_(0, rows, after)
        for j, i in enumerate(compute):
            new_states[i] = {**(new_states[i] or {}), "residual": after[j] - subset[j]}
    reused = [i for i, r in enumerate(requests) if reuse_request[r]]
    if reused:
        if out is h:
            out = h.clone()
        for i in reused:
            residual = states[i]["residual"]
            out[i] = h[i] + residual
            # kept from the last computed step until the next one
            new_states[i] = {**(new_states[i] or {}), "residual": residual}
    return module.cache_head(out, ctx), new_states, len(reused)
