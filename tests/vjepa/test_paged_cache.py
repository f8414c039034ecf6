"""The AC frame cache on mstar_kvcache's paged pool: exact vs re-prefill, forks copy no pages, pool freed."""

import pytest
import torch

pytest.importorskip("mstar_kvcache")

from mstar_vjepa.paged import PagedFrameCache, frame_pool
from mstar_vjepa.planner import CEMSettings, plan_cem
from mstar_vjepa.rollout import Rollout, normalize, prefill_prefix, rollout_reprefill

from .conftest import random_states


@pytest.mark.parametrize("horizon", [1, 5, 30])
def test_paged_rollout_equals_reprefill(ac_predictor, horizon):
    g = torch.Generator().manual_seed(2)
    ctx = normalize(torch.randn(1, 2, 4, 32, generator=g))
    states = random_states(2)[None]
    actions = torch.randn(1, horizon, 7, generator=g) * 0.05
    pool = frame_pool(ac_predictor, num_pages=40)
    cache = prefill_prefix(ac_predictor, ctx, states, PagedFrameCache(pool, 1))
    roll = Rollout(ac_predictor, cache, ctx[:, -1], states[:, -1])
    with torch.no_grad():
        z = torch.stack([roll.step(actions[:, k])[0] for k in range(horizon)], 1)
    z_ref, _ = rollout_reprefill(ac_predictor, ctx, states, actions)
    assert (z - z_ref).abs().max().item() <= 1e-5
    assert pool.num_used == horizon + 1  # one page per cached frame
    cache.free()
    assert pool.num_used == 0


def test_cem_on_forked_pages_equals_copied_pages_and_dense(ac_predictor):
    g = torch.Generator().manual_seed(3)
    ctx = normalize(torch.randn(1, 4, 4, 32, generator=g))
    states = random_states(4)[None]
    goal = normalize(torch.randn(4, 32, generator=g))
    cfg = CEMSettings(samples=10, topk=3, iterations=2)
    runs = {}
    for share in ("fork", "copy"):
        pool = frame_pool(ac_predictor, num_pages=128)
        runs[share] = plan_cem(ac_predictor, ctx, states, goal, 3, cfg, torch.Generator().manual_seed(1), share,
                               prefix_cache=PagedFrameCache(pool, 1))
        runs[share]["copies"] = pool.copies
        assert pool.num_used == 0  # every page returned
    dense = plan_cem(ac_predictor, ctx, states, goal, 3, cfg, torch.Generator().manual_seed(1))
    assert runs["fork"]["copies"] == 0 and runs["copy"]["copies"] == 2 * 10 * 3  # iterations x samples x prefix pages
    for key in ("plan", "costs"):
        assert torch.allclose(runs["fork"][key], runs["copy"][key], atol=1e-6, rtol=0)
        assert torch.allclose(runs["fork"][key], dense[key], atol=1e-5, rtol=0)


def test_forked_pages_are_shared_by_refcount(ac_predictor):
    pool = frame_pool(ac_predictor, num_pages=16)
    ctx = normalize(torch.randn(1, 3, 4, 32))
    prefix = prefill_prefix(ac_predictor, ctx, random_states(3)[None], PagedFrameCache(pool, 1))
    forked = prefix.fork(5)
    assert pool.num_used == 2 and all(pool.refcount[p] == 6 for p in prefix.tables[0])
    forked.free()
    prefix.free()
    assert pool.num_used == 0
