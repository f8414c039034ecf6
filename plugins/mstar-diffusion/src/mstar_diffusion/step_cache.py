"""Step caching (first-block cache, TeaCache-style): skip most of a DiT's blocks on steps where little changes.

Opt in per node with the engine setting `step_cache_threshold` (a number >= 0; absent: off). At each step the
DiT runs its embedding and its first block for every row; a row whose first block changed the hidden states by
nearly what it did at the row's previous step (relative L1 change of that residual below the threshold)
reuses the residual the other blocks added then, and skips them. A row that changes more runs every block and
keeps the new residuals for the next step. With threshold 0 no row is ever reused (the comparison is strict),
and the staged forward is the module's own forward, so the result is bit for bit the uncached one.

The residuals are the request's, per CFG branch: the step node outputs them as `step_cache` and takes them back
on the next call (the walk's `Loop` carries the name), so the engine still keeps nothing per request.

A module opts in by meeting `StepCacheableDenoiser`: its forward split into `cache_embed`, `cache_first_block`,
`cache_other_blocks` and `cache_head`, with a context that selects rows.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class StepCacheableDenoiser(Protocol):
    def cache_embed(self, x: torch.Tensor, t: torch.Tensor, /, **cond: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """`(hidden states [B, L, D], a context with .select(rows))`."""

    def cache_first_block(self, h: torch.Tensor, ctx: Any, /) -> torch.Tensor: ...

    def cache_other_blocks(self, h: torch.Tensor, ctx: Any, /) -> torch.Tensor: ...

    def cache_head(self, h: torch.Tensor, ctx: Any, /) -> torch.Tensor: ...


def supports_step_cache(module: Any) -> bool:
    return all(callable(getattr(module, name, None))
               for name in ("cache_embed", "cache_first_block", "cache_other_blocks", "cache_head"))


def _relative_change(now: torch.Tensor, before: torch.Tensor) -> float:
    return float((now - before).abs().mean() / before.abs().mean().clamp_min(1e-12))


def cached_forward(module: Any, x: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor],
                   states: list[tuple[torch.Tensor, torch.Tensor] | None], threshold: float
                   ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], int]:
    """The velocity of every row, each row's new state `(first-block residual, other blocks' residual)`, and
    how many rows reused their cached residual."""
    h, ctx = module.cache_embed(x, t, **cond)
    first = module.cache_first_block(h, ctx)
    first_residual = first - h
    reuse = [s is not None and s[0].shape == first_residual[i].shape
             and _relative_change(first_residual[i], s[0]) < threshold for i, s in enumerate(states)]
    compute = [i for i, r in enumerate(reuse) if not r]
    out = first.clone() if compute and len(compute) < len(reuse) else first
    new_states: list[Any] = [None] * len(states)
    if compute:
        rows = torch.tensor(compute, device=first.device)
        subset = first if len(compute) == len(reuse) else first.index_select(0, rows)
        rest = module.cache_other_blocks(subset, ctx if len(compute) == len(reuse) else ctx.select(rows))
        if len(compute) == len(reuse):
            out = rest
        else:
            out.index_copy_(0, rows, rest)
        for j, i in enumerate(compute):
            new_states[i] = (first_residual[i], rest[j] - subset[j])
    for i, reused in enumerate(reuse):
        if reused:
            cached = states[i][1]
            out[i] = first[i] + cached
            new_states[i] = (states[i][0], cached)  # compared with the last computed step: drift adds up, then recomputes
    return module.cache_head(out, ctx), new_states, sum(reuse)
