"""The vjepa2 / vjepa2-ac models load from presets in the real layouts and serve their walks through AsyncEngine."""

import asyncio

import pytest
import torch
from mstar_vjepa.model import load_vjepa2_ac
from mstar_vjepa.planner import CEMSettings, plan_cem
from mstar_vjepa.rollout import rollout_cached

from mstar_core.checkpoint import WeightMismatchError
from mstar_core.errors import RequestError
from mstar_core.model import LoadOptions
from mstar_core.runtime import AsyncEngine
from mstar_vjepa import checkpoint as ckpt


@pytest.fixture(autouse=True)
def _preset_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MSTAR_CACHE", str(tmp_path_factory.getbasetemp() / "mstar-cache"))


def _run(coro):
    return asyncio.run(coro)


def test_ac_preset_is_written_in_upstream_layout_and_reloads():
    loaded = load_vjepa2_ac(LoadOptions(preset="tiny"))
    assert loaded.random_weights
    blob = torch.load(ckpt.preset_dir("vjepa2-ac-tiny") / ckpt.AC_FILE, weights_only=True)
    assert "module.backbone.blocks.0.attn.qkv.weight" in blob["encoder"]
    assert "module.backbone.predictor_blocks.0.attn.qkv.weight" in blob["predictor"]


def test_missing_tensor_is_named(tmp_path):
    ckpt.write_ac_preset(tmp_path)
    blob = torch.load(tmp_path / ckpt.AC_FILE, weights_only=True)
    del blob["predictor"]["module.backbone.state_encoder.bias"]
    torch.save(blob, tmp_path / ckpt.AC_FILE)
    with pytest.raises(WeightMismatchError, match="state_encoder.bias"):
        ckpt.load_ac(tmp_path)


def test_hf_preset_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt.write_hf_preset(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["encoder.layer.1.attention.key.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(WeightMismatchError, match="encoder.layer.1.attention.key.weight"):
        ckpt.load_hf(tmp_path)


def _frames(n, size=32, seed=0):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def test_rollout_walk_matches_direct_cached_rollout():
    async def go():
        async with AsyncEngine() as engine:
            loaded = await engine.load_model("vjepa2-ac", LoadOptions(preset="tiny"))
            gen = torch.Generator().manual_seed(11)  # fixed inputs: the result must not depend on test order
            frames, states = _frames(2), torch.rand(2, 7, generator=gen) * 0.1
            actions = torch.randn(4, 7, generator=gen) * 0.02
            env = await engine.submit("vjepa2-ac", {"frames": frames, "states": states, "actions": actions}).result()
            ac = engine.node_engines("vjepa2-ac")["ac_predictor"]
            assert not ac.active_requests()  # cache freed when the loop ends
            if ac.pool is not None:  # paged KV pool: every page back
                assert ac.pool.num_used == 0 and ac.stats()["kv_pages_used"] == 0
            return loaded, env, frames, states, actions

    loaded, env, frames, states, actions = _run(go())
    enc = loaded.graph.nodes["encoder"].module()
    pred = loaded.graph.nodes["ac_predictor"].module()
    ctx = enc.forward_batch([{"frames": frames}])[0]["latents"]
    z, s = rollout_cached(pred, ctx[None], states[None], actions[None])
    assert len(env["latent"]) == 4
    # paged pages vs dense buffers sum in different orders: a few ulp apart at values near 1.6
    torch.testing.assert_close(torch.stack(env["latent"]), z[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(torch.stack(env["state"]), s[0], atol=1e-6, rtol=1e-5)


def test_plan_walk_matches_direct_cem():
    async def go():
        async with AsyncEngine() as engine:
            loaded = await engine.load_model("vjepa2-ac", LoadOptions(preset="tiny"))
            req = {"frames": _frames(2), "states": torch.rand(2, 7) * 0.1, "goal": _frames(1, seed=4), "horizon": 3,
                   "samples": 8, "topk": 2, "iterations": 2, "seed": 7}
            return loaded, req, await engine.submit("vjepa2-ac", req).result()

    loaded, req, env = _run(go())
    enc = loaded.graph.nodes["encoder"].module()
    pred = loaded.graph.nodes["ac_predictor"].module()
    ctx = enc.forward_batch([{"frames": req["frames"]}])[0]["latents"]
    goal = enc.forward_batch([{"frames": req["goal"]}])[0]["latents"][-1]
    ref = plan_cem(pred, ctx[None], req["states"][None], goal, 3, CEMSettings(samples=8, topk=2, iterations=2),
                   torch.Generator().manual_seed(7))
    assert env["plan"].shape == (3, 7)
    # served on paged pages, the reference on dense buffers
    assert torch.allclose(env["plan"], ref["plan"], atol=1e-6, rtol=0)
    assert torch.allclose(env["costs"], ref["costs"], atol=1e-6, rtol=0)


def test_plan_walk_runs_in_bf16_with_fp32_actions():
    """bf16 latents, fp32 pose math: the CEM statistics follow the states, so sampled actions meet poses in fp32."""
    async def go():
        async with AsyncEngine() as engine:
            await engine.load_model("vjepa2-ac", LoadOptions(preset="tiny", dtype="bfloat16"))
            req = {"frames": _frames(2), "states": torch.rand(2, 7) * 0.1, "goal": _frames(1, seed=4), "horizon": 3,
                   "samples": 8, "topk": 2, "iterations": 2, "seed": 7}
            return await engine.submit("vjepa2-ac", req).result()

    env = _run(go())
    assert env["plan"].shape == (3, 7) and env["plan"].dtype == torch.float32
    assert torch.isfinite(env["plan"]).all() and torch.isfinite(env["costs"].float()).all()


def test_vjepa2_walks_match_the_module():
    async def go():
        async with AsyncEngine() as engine:
            loaded = await engine.load_model("vjepa2", LoadOptions(preset="tiny"))
            video = _frames(2, size=16)
            enc = await engine.submit("vjepa2", {"video": video}).result()
            pred = await engine.submit("vjepa2", {"video": video, "walk": "predict"}).result()
            return loaded, video, enc, pred

    loaded, video, enc, pred = _run(go())
    model = loaded.graph.nodes["encoder"].module().model
    z = model.encode(video[None])[0]
    assert torch.allclose(enc["latents"], z) and torch.allclose(pred["predicted"], model.predict(z[None])[0])


@pytest.mark.parametrize(
    ("inputs", "field"),
    [
        ({"frames": torch.randn(2, 3, 16, 16)}, "frames"),
        ({"frames": torch.randn(1, 3, 32, 32), "actions": torch.randn(3, 7)}, "states"),
        ({"frames": torch.randn(2, 3, 32, 32), "states": torch.randn(1, 7), "actions": torch.randn(3, 7)}, "states"),
        ({"frames": torch.randn(1, 3, 32, 32), "states": torch.randn(7), "actions": torch.randn(3, 6)}, "actions"),
        ({"frames": torch.randn(1, 3, 32, 32), "states": torch.randn(7), "actions": torch.randn(9, 7)}, "actions"),
        ({"frames": torch.randn(1, 3, 32, 32), "states": torch.randn(7), "goal": torch.randn(3, 32, 32),
          "horizon": 0}, "horizon"),
        ({"frames": [["a"]], "states": torch.randn(7), "actions": torch.randn(1, 7)}, "frames"),
    ],
)
def test_prepare_names_the_bad_field(inputs, field):
    loaded = load_vjepa2_ac(LoadOptions(preset="tiny"))
    with pytest.raises(RequestError, match=f"'{field}'"):
        loaded.prepare_inputs(inputs)


def test_cancelled_rollout_frees_its_pages():
    async def go():
        async with AsyncEngine() as engine:
            await engine.load_model("vjepa2-ac", LoadOptions(preset="tiny"))
            ac = engine.node_engines("vjepa2-ac")["ac_predictor"]
            req = {"frames": _frames(1), "states": torch.rand(7) * 0.1, "actions": torch.randn(8, 7) * 0.02}
            handle = engine.submit("vjepa2-ac", req)
            async for out in handle:
                assert out.name == "latent"
                held = ac.stats().get("kv_pages_used", 1.0)
                handle.cancel()
                break
            for _ in range(50):
                if not ac.active_requests():
                    break
                await asyncio.sleep(0.02)
            return ac, held

    ac, held = _run(go())
    assert held > 0
    assert not ac.active_requests()
    if ac.pool is not None:
        assert ac.pool.num_used == 0


def test_concurrent_rollouts_batch_and_stay_exact():
    reqs = [{"frames": _frames(1, seed=i), "states": torch.rand(7) * 0.1, "actions": torch.randn(h, 7) * 0.02}
            for i, h in enumerate((5, 5, 3, 6))]

    async def go():
        async with AsyncEngine() as engine:
            loaded = await engine.load_model("vjepa2-ac", LoadOptions(preset="tiny"))
            envs = await asyncio.gather(*(engine.submit("vjepa2-ac", r).result() for r in reqs))
            ac = engine.node_engines("vjepa2-ac")["ac_predictor"]
            return loaded, envs, ac

    loaded, envs, ac = _run(go())
    enc = loaded.graph.nodes["encoder"].module()
    for req, env in zip(reqs, envs, strict=True):
        ctx = enc(req["frames"])["latents"]
        z, _ = rollout_cached(ac.module, ctx[None], req["states"][None, None], req["actions"][None])
        assert (torch.stack(env["latent"]) - z[0]).abs().max() <= 1e-5
    if ac.pool is not None:
        assert ac.largest_batch > 1  # requests at the same step shared predictor passes
        assert ac.pool.num_used == 0


def test_ac_parts_hosted_elsewhere_are_built_on_the_meta_device():
    encoder_elsewhere = load_vjepa2_ac(LoadOptions(preset="tiny", remote=("encoder",))).graph.nodes
    assert all(p.is_meta for p in encoder_elsewhere["encoder"].module().encoder.parameters())
    assert not any(p.is_meta for p in encoder_elsewhere["ac_predictor"].module().parameters())
    # the walks' function nodes embed frames with the predictor's weights: it stays while one of them runs here
    predictor_elsewhere = load_vjepa2_ac(LoadOptions(preset="tiny", remote=("ac_predictor",))).graph.nodes
    assert not any(p.is_meta for p in predictor_elsewhere["ac_predictor"].module().parameters())
    remote = ("ac_predictor", "rollout_step", "sample_step", "cem_start", "encoder")
    nothing_here = load_vjepa2_ac(LoadOptions(preset="tiny", remote=remote)).graph.nodes
    assert all(p.is_meta for p in nothing_here["encoder"].module().encoder.parameters())
    assert all(p.is_meta for p in nothing_here["ac_predictor"].module().parameters())
