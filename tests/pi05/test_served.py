"""pi0 / pi0.5 served by the shared engines equal the dense single-request reference; batching changes nothing."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from mstar_pi05.model import SPECS
from mstar_pi05.prepare import STATE_BINS, bin_state

from mstar_core.model import LoadOptions
from mstar_core.runtime import AsyncEngine
from mstar_pi05 import reference

SPEC = {s.name: s for s in SPECS}


def _request(i: int) -> dict:
    g = torch.Generator().manual_seed(100 + i)
    images = [torch.randint(0, 256, (20 + i, 30, 3), dtype=torch.uint8, generator=g) for _ in range(1 + i % 2)]
    return {"images": images, "prompt": f"pick up cube {i}", "state": torch.randn(3 + i, generator=g),
            "horizon": 5 - i % 2, "num_steps": 3, "seed": 7 + i, "action_dim": 6}


def _expected(loaded, inputs) -> torch.Tensor:
    policy, env = loaded.extras["policy"], loaded.prepare_inputs(inputs)
    n_image = env["image_at"].numel()
    with torch.inference_mode():
        image_tokens = policy.encode_images(env["pixels"])
    noise = torch.randn(env["latent_shape"], generator=torch.Generator().manual_seed(env["seed"]))
    state = env.get("state_row")
    x = reference.sample_actions(policy, image_tokens, env["prefix_ids"][n_image:], noise, state=state,
                                 num_steps=env["num_steps"])
    return loaded.prepare.unnormalize_actions(x)[:, : env["action_dim"]]


@pytest.mark.parametrize("kind", ["pi05", "pi0"])
def test_served_equals_reference_batched_and_alone(kind):
    loaded = SPEC[kind].load(LoadOptions(preset="tiny"))
    requests = [_request(i) for i in range(3)]

    async def run():
        async with AsyncEngine() as engine:
            await engine.load_model(kind, LoadOptions(preset="tiny"))
            together = await asyncio.gather(*(engine.submit(kind, r).result() for r in requests))
            alone = [await engine.submit(kind, r).result() for r in requests]
            return [e["actions"] for e in together], [e["actions"] for e in alone]

    together, alone = asyncio.run(run())
    for r, a, b in zip(requests, together, alone, strict=True):
        want = _expected(loaded, r)
        assert a.shape == (r["horizon"], 6)
        assert (a - want).abs().max() <= 1e-5
        assert (a - b).abs().max() <= 1e-5


def test_state_binning_is_numpy_digitize():
    edges = np.array([-1.0, 1.0, -1.5, 1.5, *STATE_BINS[[1, 2, 127, 128, 255]], np.nextafter(STATE_BINS[5], -2), 0.0])
    got = bin_state(edges)
    assert (got == np.digitize(edges, STATE_BINS) - 1).all()
    assert got[0] == 0 and got[1] == 255 and got[2] == -1 and got[3] == 255
    assert list(got[4:9]) == [1, 2, 127, 128, 255] and got[9] == 4  # a boundary opens its bin; just below stays
