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
    # both rows compute at step 0 (nothing cached yet) and at the last step (the output), and reuse on the 4 between
    assert stats["diffusion_cache_computed_rows"] == 2 * 2 and stats["diffusion_cache_reused_rows"] == 4 * 2
    assert not torch.equal(envs[0]["latents"], uncached[0][0]["latents"])
    assert envs[0]["video"].shape == uncached[0][0]["video"].shape


def test_a_negative_threshold_fails_the_load():
    with pytest.raises(ModelLoadError, match="step_cache_threshold"):
        _serve({"denoise": {"step_cache_threshold": -1}})


class _Rows:
    """The context of a toy denoiser: its rows' scale (select keeps the chosen rows)."""

    def __init__(self, scale):
        self.scale = scale

    def select(self, rows):
        return _Rows(self.scale.index_select(0, rows))


class _Toy:
    """A denoiser in the step cache's four stages that records what each stage saw."""

    def __init__(self):
        self.indicator_rows, self.block_rows = [], []

    def cache_embed(self, x, t, /, scale):
        return x.clone(), _Rows(scale)

    def cache_indicator(self, h, ctx, /):
        self.indicator_rows.append(h.shape[0])
        return h * ctx.scale[:, None]

    def cache_blocks(self, h, ctx, /):
        self.block_rows.append(h.shape[0])
        return 2 * h + 1

    def cache_head(self, h, ctx, /):
        return h


def test_one_decision_per_request_on_one_row_and_the_sum_restarts_after_a_computed_step():
    from mstar_diffusion.step_cache import cached_forward

    toy = _Toy()
    scale = torch.ones(4)
    # two requests (a: rows 0, 1; b: rows 2, 3), as the engine stacks their cond and uncond rows
    requests, force = ["a", "a", "b", "b"], [False] * 4
    x = torch.ones(4, 3)
    _, states, reused = cached_forward(toy, x, torch.zeros(4), {"scale": scale}, [None] * 4, 0.5, requests, force)
    assert reused == 0 and toy.indicator_rows == [2] and toy.block_rows == [4]  # the indicator on one row each
    # request a's input moves by 10%, b's by 60%: a reuses (both its rows), b computes (both its rows)
    x2 = torch.cat([1.1 * torch.ones(2, 3), 1.6 * torch.ones(2, 3)])
    v, states2, reused = cached_forward(toy, x2, torch.zeros(4), {"scale": scale}, states, 0.5, requests, force)
    assert reused == 2 and toy.block_rows[-1] == 2
    assert torch.allclose(v[:2], x2[:2] + (2 * x[:2] + 1 - x[:2]))  # the residual of step 0 on today's input
    assert torch.equal(v[2:], 2 * x2[2:] + 1)
    assert float(states2[0]["accumulated"]) == pytest.approx(0.1, rel=1e-5) and float(states2[2]["accumulated"]) == 0
    # a moves by another 45%: the sum (0.1 + ~0.41) passes 0.5, so it computes and starts again from 0
    x3 = torch.cat([1.6 * torch.ones(2, 3), 1.6 * torch.ones(2, 3)])
    _, states3, reused = cached_forward(toy, x3, torch.zeros(4), {"scale": scale}, states2, 0.5, requests, force)
    assert reused == 2 and float(states3[0]["accumulated"]) == 0  # (b, unmoved, reused this time)
    # the last step always computes, however little moved
    _, _, reused = cached_forward(toy, x3, torch.zeros(4), {"scale": scale}, states3, 0.5, requests, [True] * 4)
    assert reused == 0
