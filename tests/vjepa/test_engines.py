"""The AC engines under AsyncEngine: the plan walk on forked paged context pages, FIFO page admission, 413s."""

import asyncio

import pytest
import torch
from mstar_vjepa.planner import CEMSettings, plan_cem
from mstar_vjepa.rollout import rollout_cached

from mstar_core.errors import RequestError
from mstar_core.model import LoadOptions
from mstar_core.runtime import AsyncEngine

pytest.importorskip("mstar_kvcache")


@pytest.fixture(autouse=True)
def _preset_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MSTAR_CACHE", str(tmp_path_factory.getbasetemp() / "mstar-cache"))


def _frames(n, seed=0):
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def _plan_request(iterations=2, **kw):
    states = torch.rand(3, 7, generator=torch.Generator().manual_seed(5)) * 0.1
    return {"frames": _frames(3), "states": states, "goal": _frames(1, seed=4), "horizon": 3,
            "samples": 6, "topk": 2, "iterations": iterations, "seed": 7, **kw}


async def _wait_idle(eng, tries=100):
    for _ in range(tries):
        if not eng.active_requests():
            return
        await asyncio.sleep(0.02)


def test_served_plan_forks_paged_context_pages_and_frees_them():
    async def go():
        async with AsyncEngine() as engine:
            loaded = await engine.load_model("vjepa2-ac", LoadOptions(preset="tiny"))
            planner = engine.node_engines("vjepa2-ac")["planner"]
            env = await engine.submit("vjepa2-ac", _plan_request()).result()
            return loaded, planner, env

    loaded, planner, env = asyncio.run(go())
    pool = planner.pool
    assert pool is not None and planner.kind == "vjepa_cem"
    assert pool.num_used == 0 and not planner.active_requests() and not planner.reserved
    assert pool.copies == 0  # samples shared the context pages by refcount, nothing was copied
    assert pool.kv.abs().sum() > 0  # and the rollouts really ran in the pool
    req = _plan_request()
    enc = loaded.graph.nodes["encoder"].module()
    ctx = enc.forward_batch([{"frames": req["frames"]}])[0]["latents"]
    goal = enc.forward_batch([{"frames": req["goal"]}])[0]["latents"][-1]
    cfg = CEMSettings(samples=6, topk=2, iterations=2)
    dense = plan_cem(planner.predictor, ctx[None], req["states"][None], goal, 3, cfg, torch.Generator().manual_seed(7))
    assert torch.allclose(env["plan"], dense["plan"], atol=1e-6, rtol=0)
    assert torch.allclose(env["costs"], dense["costs"], atol=1e-6, rtol=0)


def test_cancelled_plan_frees_its_pages():
    async def go():
        async with AsyncEngine() as engine:
            await engine.load_model("vjepa2-ac", LoadOptions(preset="tiny"))
            planner = engine.node_engines("vjepa2-ac")["planner"]
            handle = engine.submit("vjepa2-ac", _plan_request(iterations=1000))
            held = 0.0
            for _ in range(500):  # wait until the plan is running and holds its context pages
                stats = planner.stats()
                if stats["plans_running"] and stats["kv_pages_used"]:
                    held = stats["kv_pages_used"]
                    break
                await asyncio.sleep(0.01)
            handle.cancel()
            await _wait_idle(planner)
            return planner, held

    planner, held = asyncio.run(go())
    assert held >= 2  # the two cached context frames (forks come and go within an iteration)
    assert not planner.active_requests() and not planner.runs and not planner.reserved
    assert planner.pool.num_used == 0


def test_rollouts_wait_for_pages_in_arrival_order_instead_of_failing():
    # each rollout needs 6 pages (1 context frame, 6 steps); the pool holds one at a time
    reqs = [{"frames": _frames(1, seed=i), "states": torch.rand(7) * 0.1, "actions": torch.randn(6, 7) * 0.02}
            for i in range(3)]

    async def go():
        async with AsyncEngine() as engine:
            loaded = await engine.load_model("vjepa2-ac", LoadOptions(preset="tiny"),
                                             settings={"ac_predictor": {"num_pages": 8}})
            ac = engine.node_engines("vjepa2-ac")["ac_predictor"]
            events: list[int] = []
            waited = 0.0

            async def one(i, handle):
                nonlocal waited
                async for _ in handle:
                    events.append(i)
                    waited = max(waited, ac.stats()["waiting_for_pages"])
                return await handle.result()

            handles = [engine.submit("vjepa2-ac", r) for r in reqs]
            envs = await asyncio.gather(*(one(i, h) for i, h in enumerate(handles)))
            return loaded, ac, envs, events, waited

    loaded, ac, envs, events, waited = asyncio.run(go())
    assert waited >= 1  # someone really queued for pages
    runs = [events[0]] + [b for a, b in zip(events, events[1:], strict=False) if a != b]
    assert sorted(runs) == [0, 1, 2]  # each rollout ran start to finish alone: its outputs are contiguous
    assert ac.pool.num_used == 0 and not ac.reserved and not ac.active_requests()
    enc = loaded.graph.nodes["encoder"].module()
    for req, env in zip(reqs, envs, strict=True):
        ctx = enc(req["frames"])["latents"]
        z, _ = rollout_cached(ac.module, ctx[None], req["states"][None, None], req["actions"][None])
        assert (torch.stack(env["latent"]) - z[0]).abs().max() <= 1e-5


def test_request_larger_than_the_pool_fails_with_413_and_others_still_run():
    async def go():
        async with AsyncEngine() as engine:
            await engine.load_model("vjepa2-ac", LoadOptions(preset="tiny"),
                                    settings={"ac_predictor": {"num_pages": 4}, "planner": {"num_pages": 10}})
            big_roll = engine.submit("vjepa2-ac", {"frames": _frames(1), "states": torch.rand(7) * 0.1,
                                                   "actions": torch.randn(5, 7) * 0.02})
            big_plan = engine.submit("vjepa2-ac", _plan_request(samples=6))  # 2 + 6 x 3 = 20 pages > 10
            small = engine.submit("vjepa2-ac", {"frames": _frames(1), "states": torch.rand(7) * 0.1,
                                                "actions": torch.randn(4, 7) * 0.02})
            errors = []
            for handle in (big_roll, big_plan):
                with pytest.raises(RequestError) as info:
                    await handle.result()
                errors.append(info.value)
            env = await small.result()
            nodes = engine.node_engines("vjepa2-ac")
            return errors, env, nodes

    (roll_err, plan_err), env, nodes = asyncio.run(go())
    assert roll_err.status == 413 and "needs 5 KV pages" in str(roll_err) and "num_pages" in str(roll_err)
    assert plan_err.status == 413 and "needs 20 KV pages" in str(plan_err) and "'samples'" in str(plan_err)
    assert len(env["latent"]) == 4
    for eng in nodes.values():
        assert not eng.active_requests()
    assert nodes["ac_predictor"].pool.num_used == 0 and nodes["planner"].pool.num_used == 0
