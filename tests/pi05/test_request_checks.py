"""pi0 / pi0.5 requests are checked exactly (finite pixels and state, a 1-D non-empty state, a non-empty prompt),
and a non-finite action fails its request instead of reaching a robot. Both the native walk and openpi's socket
go through this `prepare`, so both refuse the same inputs."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from mstar_pi05.model import SPECS

from mstar_core.errors import RequestError
from mstar_core.model import LoadOptions
from mstar_core.runtime import AsyncEngine

SPEC = {s.name: s for s in SPECS}


def good() -> dict:
    return {"images": [torch.randint(0, 256, (8, 10, 3), dtype=torch.uint8)], "prompt": "pick up the cube",
            "state": torch.tensor([0.1, -0.2, 0.3]), "horizon": 2, "num_steps": 1, "action_dim": 4}


def nan_image() -> torch.Tensor:
    image = torch.rand(8, 10, 3)
    image[2, 3, 1] = float("nan")
    return image


BAD = {
    "nan_image": ({"images": [nan_image()]}, "images[0]", "non-finite"),
    "inf_image": ({"images": [torch.full((8, 10, 3), float("inf"))]}, "images[0]", "non-finite"),
    "nan_state": ({"state": torch.tensor([0.1, float("nan"), 0.3])}, "state", "non-finite"),
    "inf_state": ({"state": torch.tensor([float("-inf"), 0.0])}, "state", "non-finite"),
    "empty_state": ({"state": torch.zeros(0)}, "state", "empty"),
    "2d_state": ({"state": torch.zeros(2, 3)}, "state", "1-D"),
    "empty_prompt": ({"prompt": ""}, "prompt", "empty"),
    "blank_prompt": ({"prompt": "   "}, "prompt", "empty"),
}


@pytest.fixture(scope="module", params=["pi05", "pi0"])
def loaded(request):
    return SPEC[request.param].load(LoadOptions(preset="tiny"))


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_inputs_are_a_400_naming_the_field(loaded, case):
    change, param, words = BAD[case]
    with pytest.raises(RequestError) as err:
        loaded.prepare_inputs({**good(), **change})
    assert err.value.status == 400 and err.value.param == param and words in str(err.value)


def test_good_inputs_still_prepare(loaded):
    env = loaded.prepare_inputs(good())
    assert torch.isfinite(env["pixels"]).all()


@pytest.mark.parametrize("kind", ["pi05", "pi0"])
def test_non_finite_actions_fail_the_request(kind):
    async def run():
        async with AsyncEngine() as engine:
            loaded = await engine.load_model(kind, LoadOptions(preset="tiny"))
            ok = await engine.submit(kind, good()).result()
            # statistics that unnormalise every action to infinity: the output must not come back
            n = loaded.prepare.cfg.max_action_dim
            loaded.prepare.stats = {"action": {"q01": [0.0] * n, "q99": [np.inf] * n}}
            with pytest.raises(RequestError) as err:
                await engine.submit(kind, good()).result()
            return ok, err.value

    ok, err = asyncio.run(run())
    assert torch.isfinite(ok["actions"]).all()
    assert err.status == 500 and "non-finite action" in str(err)
