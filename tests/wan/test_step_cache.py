"""The diffusion engine's step cache on Wan: threshold 0 is the uncached video exactly; a high one skips blocks."""

from __future__ import annotations

import asyncio

import pytest
import torch

from mstar_core.errors import ModelLoadError
from mstar_core.model import LoadOptions
from mstar_core.runtime import AsyncEngine

# one request at a time: its forwards then always hold the same rows (cond, uncond), so bits can be compared
REQUESTS = [{"prompt": "a lighthouse at night", "seed": 11, "num_steps": 6}]


def _serve(settings=None):
    async def go():
        async with AsyncEngine() as engine:
            await engine.load_model("wan", LoadOptions(preset="tiny"), settings=settings)
            envs = [await engine.generate("wan", r) for r in REQUESTS]
            return envs, dict(engine.node_engines("wan")["denoise"].stats())

    return asyncio.run(go())


@pytest.fixture(scope="module")
def uncached():
    return _serve()


def test_threshold_zero_is_the_uncached_video_bit_for_bit(uncached):
    envs, stats = _serve({"denoise": {"step_cache_threshold": 0}})
    for env, want in zip(envs, uncached[0], strict=True):
        assert torch.equal(env["latents"], want["latents"]) and torch.equal(env["video"], want["video"])
    assert stats["diffusion_cache_reused_rows"] == 0 and stats["diffusion_cache_computed_rows"] == 6 * 2


def test_a_high_threshold_reuses_rows_after_the_first_step(uncached):
    envs, stats = _serve({"denoise": {"step_cache_threshold": 1e9}})
    # every row computes at step 0 (nothing cached yet) and is reused on the 5 steps after
    assert stats["diffusion_cache_computed_rows"] == 2 and stats["diffusion_cache_reused_rows"] == 5 * 2
    assert not torch.equal(envs[0]["latents"], uncached[0][0]["latents"])
    assert envs[0]["video"].shape == uncached[0][0]["video"].shape


def test_a_negative_threshold_fails_the_load():
    with pytest.raises(ModelLoadError, match="step_cache_threshold"):
        _serve({"denoise": {"step_cache_threshold": -1}})
