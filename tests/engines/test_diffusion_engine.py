"""The `diffusion` engine behind the real runtime: a tiny flow-matching DiT in a Walk Graph's visible `Loop`.

The oracle is diffusers' `FlowMatchEulerDiscreteScheduler` (shift 3.0) driving the same module from the
same noise in a plain loop. Also: continuous batching of many requests (each equal to its run alone),
velocity from another node, cancellation mid-loop, and bad settings failing their request alone.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from mstar_diffusion.example import TinyFlowDiT, dit_graph, velocity_graph

from mstar_core.errors import RequestError
from mstar_core.model import LoadedModel
from mstar_core.runtime import AsyncEngine

SHAPE = [4, 4, 4]


@pytest.fixture(scope="module")
def dit() -> TinyFlowDiT:
    return TinyFlowDiT(channels=4, hidden=32, layers=2, heads=2, context_dim=8, seed=0).eval()


def _context(seed: int, length: int = 3) -> torch.Tensor:
    return torch.randn(length, 8, generator=torch.Generator().manual_seed(1000 + seed))


def _request(seed: int, steps: int, guidance: float = 1.0, **extra) -> dict:
    inputs = {"num_steps": steps, "latent_shape": SHAPE, "seed": seed, "shift": 3.0, "context": _context(seed)}
    if guidance != 1.0:
        inputs |= {"guidance_scale": guidance, "context_uncond": torch.zeros(3, 8)}
    return inputs | extra


def _reference(dit: TinyFlowDiT, seed: int, steps: int, guidance: float = 1.0) -> torch.Tensor:
    """A plain loop: diffusers' scheduler, the same module, the same noise (drawn from the request's seed)."""
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(steps)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))[None]
    context = _context(seed)[None]
    with torch.no_grad():
        for t in scheduler.timesteps:
            v = dit(x, t.expand(1), context=context)
            if guidance != 1.0:
                v_uncond = dit(x, t.expand(1), context=torch.zeros(1, 3, 8))
                v = v_uncond + guidance * (v - v_uncond)
            x = scheduler.step(v, t, x).prev_sample
    return x[0]


async def _serve(graph, settings=None) -> AsyncEngine:
    engine = AsyncEngine()
    await engine.add_model(LoadedModel(graph.name, graph, random_weights=True), settings=settings)
    return engine


def test_dit_loop_matches_diffusers_flow_match_euler(dit):
    async def main():
        engine = await _serve(dit_graph(dit))
        try:
            plain = await engine.generate("tiny-dit", _request(7, 6))
            guided = await engine.generate("tiny-dit", _request(8, 5, guidance=3.0))
            return plain, guided
        finally:
            await engine.close()

    plain, guided = asyncio.run(main())
    assert plain["seed"] == 7
    torch.testing.assert_close(plain["latents"], _reference(dit, 7, 6), rtol=0, atol=1e-5)
    torch.testing.assert_close(guided["latents"], _reference(dit, 8, 5, guidance=3.0), rtol=0, atol=1e-5)


def test_schedules_match_their_references():
    from mstar_diffusion.schedules import diffusers_flow_match_euler, flow_euler

    for steps in (1, 4, 28, 50):
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
        scheduler.set_timesteps(steps)
        ours = diffusers_flow_match_euler(steps, 3.0).to(torch.float32)
        torch.testing.assert_close(ours, scheduler.sigmas, rtol=0, atol=1e-7)
    # BAGEL: linspace(1, 0, num_timesteps) shifted, num_timesteps - 1 steps
    t = torch.linspace(1, 0, 50, dtype=torch.float64)
    torch.testing.assert_close(flow_euler(49, 3.0), 3.0 * t / (1 + 2.0 * t))
    # pi0.5: t = 1 down to 0 by dt = -0.1 (no shift)
    torch.testing.assert_close(flow_euler(10, 1.0), torch.arange(10, -1, -1, dtype=torch.float64) / 10)


def test_concurrent_requests_equal_their_runs_alone_and_share_steps(dit):
    plan = [(seed, 2 + seed, 3.0 if seed % 3 == 0 else 1.0) for seed in range(8)]  # 2..9 steps, some guided

    async def main():
        engine = await _serve(dit_graph(dit))
        try:
            alone = [(await engine.generate("tiny-dit", _request(*p)))["latents"] for p in plan]
            node = engine.node_engines("tiny-dit")["denoise"]
            before = node.stats()
            assert before["diffusion_max_requests_per_step"] == 1
            together = await asyncio.gather(*(engine.generate("tiny-dit", _request(*p)) for p in plan))
            return alone, [env["latents"] for env in together], node.stats(), node.active_requests()
        finally:
            await engine.close()

    alone, together, stats, active = asyncio.run(main())
    for (seed, _, _), a, b in zip(plan, alone, together, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=lambda m, s=seed: f"request with seed {s}: {m}")
    assert stats["diffusion_max_requests_per_step"] >= 4, stats  # rows of different requests in one step
    assert stats["diffusion_max_rows"] >= 6, stats  # ... and in one forward, guidance branches included
    assert stats["diffusion_mixed_sigma_steps"] >= 1, stats  # each row at its own timestep
    assert not active and stats["diffusion_queued"] == 0


def test_velocity_from_another_node_equals_the_dit_node(dit):
    """Use (b): a stateless node computes cond/uncond velocities, the diffusion node only guides and steps."""
    async def main():
        a = await _serve(dit_graph(dit))
        b = await _serve(velocity_graph(dit))
        try:
            ins = [_request(s, 4, guidance=2.5, cfg_renorm="global") for s in (3, 4)]
            dit_out = await asyncio.gather(*(a.generate("tiny-dit", i) for i in ins))
            vel_out = await asyncio.gather(*(b.generate("tiny-dit-velocity", i) for i in ins))
            euler = b.node_engines("tiny-dit-velocity")["euler"]
            return dit_out, vel_out, euler.stats()
        finally:
            await a.close()
            await b.close()

    dit_out, vel_out, stats = asyncio.run(main())
    for x, y in zip(dit_out, vel_out, strict=True):
        torch.testing.assert_close(y["latents"], x["latents"], rtol=0, atol=1e-5)
    assert stats["diffusion_max_requests_per_step"] == 2


def test_cancel_mid_loop_frees_everything(dit):
    async def main():
        engine = await _serve(dit_graph(dit))
        try:
            node = engine.node_engines("tiny-dit")["denoise"]
            survivor_alone = (await engine.generate("tiny-dit", _request(5, 6)))["latents"]
            long = engine.submit("tiny-dit", _request(1, 900, guidance=2.0))
            survivor = engine.submit("tiny-dit", _request(5, 6))
            start = node.num_steps
            while node.num_steps < start + 10:
                await asyncio.sleep(0.002)
            assert not long.done  # mid-loop: 10 steps in, 890 to go
            long.cancel()
            with pytest.raises(RequestError):
                await long.result()
            survived = (await survivor.result())["latents"]
            for _ in range(100):
                if not node.active_requests():
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            assert node.num_steps - start < 100  # the cancelled loop stopped; it did not run on unseen
            return node, survivor_alone, survived
        finally:
            await engine.close()

    node, alone, survived = asyncio.run(main())
    torch.testing.assert_close(survived, alone, rtol=0, atol=1e-6)
    assert not node.active_requests() and not node.queue and not node.answered
    assert node.stats()["diffusion_queued"] == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_steps", "6"), ("num_steps", 2.5), ("num_steps", True), ("num_steps", 0), ("num_steps", 10**6),
        ("shift", -1.0), ("shift", 0), ("shift", "3"), ("shift", float("nan")),
        ("seed", -1), ("seed", 2**63), ("seed", "abc"), ("seed", 1.5),
        ("latent_shape", [4, 4]), ("latent_shape", [3, 4, 4]), ("latent_shape", [4, 0, 4]), ("latent_shape", "4x4"),
        ("latent_shape", [4, 4096, 4096]),
        ("guidance_scale", -2.0), ("cfg_renorm", "bogus"), ("cfg_interval", [0.8, 0.2]), ("cfg_renorm_min", 2.0),
    ],
)
def test_bad_settings_fail_their_request_alone_with_a_400(dit, field, value):
    async def main():
        engine = await _serve(dit_graph(dit))
        try:
            good = engine.submit("tiny-dit", _request(2, 3))
            bad = engine.submit("tiny-dit", _request(3, 3) | {field: value})
            with pytest.raises(RequestError) as failure:
                await bad.result()
            env = await good.result()
            return failure.value, env, engine.node_engines("tiny-dit")
        finally:
            await engine.close()

    error, env, nodes = asyncio.run(main())
    assert 400 <= error.status < 500, error
    assert f"'{field}'" in str(error)
    assert env["latents"].shape == tuple(SHAPE)
    assert all(not n.active_requests() for n in nodes.values())


def test_guidance_without_its_unconditional_input_is_a_400(dit):
    async def main():
        engine = await _serve(dit_graph(dit))
        try:
            with pytest.raises(RequestError) as failure:
                await engine.generate("tiny-dit", _request(3, 3) | {"guidance_scale": 4.0})
            return failure.value
        finally:
            await engine.close()

    error = asyncio.run(main())
    assert error.status == 400 and "'context_uncond'" in str(error)


def test_missing_seed_draws_a_fresh_one_and_reports_it(dit):
    async def main():
        engine = await _serve(dit_graph(dit))
        try:
            inputs = _request(0, 2)
            del inputs["seed"]
            first, second = [await engine.generate("tiny-dit", dict(inputs)) for _ in range(2)]
            again = await engine.generate("tiny-dit", inputs | {"seed": first["seed"]})
            return first, second, again
        finally:
            await engine.close()

    first, second, again = asyncio.run(main())
    assert isinstance(first["seed"], int) and first["seed"] != second["seed"]
    assert not torch.equal(first["latents"], second["latents"])
    assert torch.equal(again["latents"], first["latents"])  # the reported seed repeats the run
