"""V-JEPA 2-AC served on the shared `kvcache` engine: what the private AC engines and paged frame cache used to show.

Cached rollouts on the engine's pages equal upstream's re-prefill loop; CEM samples are forks of the context
label (no page copied) and give the in-process plan on dense forks or copies; cancelling frees every page; a
pool too small for the concurrent rollouts preempts and recomputes (exactly) instead of failing, and one
request larger than the whole pool fails alone with a 413.
"""

import asyncio

import pytest
import torch
from mstar_vjepa.planner import CEMSettings, plan_cem
from mstar_vjepa.rollout import rollout_reprefill

from mstar_core.errors import RequestError
from mstar_core.model import LoadOptions
from mstar_core.runtime import AsyncEngine


@pytest.fixture(autouse=True)
def _preset_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MSTAR_CACHE", str(tmp_path_factory.getbasetemp() / "mstar-cache"))


def _frames(n, seed=0):
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def _rollout(n_ctx, horizon, seed=0):
    g = torch.Generator().manual_seed(100 + seed)
    return {"frames": _frames(n_ctx, seed), "states": torch.rand(n_ctx, 7, generator=g) * 0.1,
            "actions": torch.randn(horizon, 7, generator=g) * 0.05}


def _plan(iterations=2, **kw):
    states = torch.rand(3, 7, generator=torch.Generator().manual_seed(5)) * 0.1
    return {"frames": _frames(3), "states": states, "goal": _frames(1, seed=4), "horizon": 3,
            "samples": 6, "topk": 2, "iterations": iterations, "seed": 7, **kw}


async def _idle(eng, tries=200):
    for _ in range(tries):
        if not eng.active_requests():
            return
        await asyncio.sleep(0.02)


def _serve(requests, settings=None, during=None):
    """Run `requests` concurrently; returns (loaded model, the predictor's engine, envs or exceptions, during's result)."""

    async def go():
        async with AsyncEngine() as engine:
            loaded = await engine.load_model("vjepa2-ac", LoadOptions(preset="tiny"), settings=settings or {})
            ac = engine.node_engines("vjepa2-ac")["ac_predictor"]
            handles = [engine.submit("vjepa2-ac", r) for r in requests]
            seen = await during(ac, handles) if during else None
            envs = await asyncio.gather(*(h.result() for h in handles), return_exceptions=True)
            await _idle(ac)
            return loaded, ac, envs, seen

    return asyncio.run(go())


def _reference(loaded, ac, req):
    enc = loaded.graph.nodes["encoder"].module()
    ctx = enc(req["frames"])["latents"]
    return rollout_reprefill(ac.module, ctx[None], req["states"][None], req["actions"][None])


@pytest.mark.parametrize(("n_ctx", "horizon"), [(1, 1), (2, 5), (1, 8), (3, 6)])
def test_cached_rollout_on_engine_pages_equals_reprefill(n_ctx, horizon):
    req = _rollout(n_ctx, horizon)
    loaded, ac, (env,), _ = _serve([req])
    z, s = _reference(loaded, ac, req)
    assert len(env["latent"]) == horizon
    assert (torch.stack(env["latent"]) - z[0]).abs().max() <= 1e-5
    assert (torch.stack(env["state"]) - s[0]).abs().max() <= 1e-6
    assert ac.pool.page_size == 6 and ac.pool.num_used == 0 and not ac.active_requests()  # one page per step


def test_plan_samples_are_forks_of_the_context_label_and_equal_dense_plans():
    async def watch(ac, handles):  # the most pages held at once, sampled while the plan runs
        peak = 0
        while not handles[0].done:
            peak = max(peak, ac.pool.num_used)
            await asyncio.sleep(0)
        return peak

    req = _plan()
    loaded, ac, (env,), peak = _serve([req], during=watch)
    assert ac.pool.copies == 0 and ac.pool.num_used == 0 and not ac.active_requests()
    assert ac.largest_batch == 6  # every sample's step in one forward
    # 2 context frames cached once + 6 samples x 3 steps of their own, never 6 copies of the context
    assert 2 < peak <= 2 + 6 * 3
    enc = loaded.graph.nodes["encoder"].module()
    ctx = enc(req["frames"])["latents"][None]
    goal = enc(req["goal"])["latents"][-1]
    cfg = CEMSettings(samples=6, topk=2, iterations=2)
    ref = plan_cem(ac.module, ctx, req["states"][None], goal, 3, cfg, torch.Generator().manual_seed(7))
    assert torch.allclose(env["plan"], ref["plan"], atol=1e-6, rtol=0)
    assert torch.allclose(env["costs"], ref["costs"], atol=1e-6, rtol=0)


def test_single_context_frame_plan_needs_no_prefix():
    req = _plan(frames=_frames(1), states=torch.rand(1, 7) * 0.1, iterations=1)
    loaded, ac, (env,), _ = _serve([req])
    enc = loaded.graph.nodes["encoder"].module()
    ref = plan_cem(ac.module, enc(req["frames"])["latents"][None], req["states"][None],
                   enc(req["goal"])["latents"][-1], 3, CEMSettings(samples=6, topk=2, iterations=1),
                   torch.Generator().manual_seed(7))
    assert torch.allclose(env["costs"], ref["costs"], atol=1e-6, rtol=0) and ac.pool.num_used == 0


def test_cancelled_plan_frees_its_pages():
    async def cancel(ac, handles):
        held = 0
        for _ in range(1000):  # until the plan runs and holds its context pages
            held = ac.pool.num_used
            if held >= 2:
                break
            await asyncio.sleep(0.005)
        handles[0].cancel()
        return held

    _, ac, (err,), held = _serve([_plan(iterations=1000)], during=cancel)
    assert held >= 2 and isinstance(err, BaseException)
    assert not ac.active_requests() and not ac.seqs and ac.pool.num_used == 0


def test_a_pool_too_small_for_concurrent_rollouts_preempts_and_recomputes_exactly():
    # each rollout holds up to 6 pages (1 context frame, 6 steps); 8 pages for three of them
    reqs = [_rollout(1, 6, seed=i) for i in range(3)]
    loaded, ac, envs, _ = _serve(reqs, settings={"ac_predictor": {"num_pages": 8}})
    assert ac.num_preemptions > 0 and ac.pool.num_used == 0 and not ac.active_requests()
    for req, env in zip(reqs, envs, strict=True):
        z, _ = _reference(loaded, ac, req)
        assert (torch.stack(env["latent"]) - z[0]).abs().max() <= 1e-5


def test_a_rollout_larger_than_the_pool_fails_with_413_and_others_still_run():
    big, small = _rollout(1, 5), _rollout(1, 4, seed=1)  # 5 and 4 pages at their last step
    _, ac, (err, env), _ = _serve([big, small], settings={"ac_predictor": {"num_pages": 4}})
    assert isinstance(err, RequestError) and err.status == 413
    assert "needs 5 KV pages" in str(err) and "num_pages" in str(err)
    assert len(env["latent"]) == 4 and ac.pool.num_used == 0 and not ac.active_requests()
