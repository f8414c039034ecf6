"""pi0 in M*'s modules equals transformers' PI0ForConditionalGeneration.sample_actions (same weights, same noise)."""

from __future__ import annotations

import pytest
import torch
from mstar_pi05.checkpoint import load_policy

from mstar_core.checkpoint import save_hf_checkpoint
from mstar_pi05 import reference
from tests.pi05.hf_oracle import IMAGE_TOKEN, LEROBOT_CONFIG, hf_pi0, lerobot_state_dict

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = hf_pi0()
    directory = tmp_path_factory.mktemp("pi0-tiny")
    save_hf_checkpoint(lerobot_state_dict(hf), directory, LEROBOT_CONFIG)
    return hf, load_policy(directory, progress=False)


def _inputs(seed: int = 0, cams: int = 2):
    g = torch.Generator().manual_seed(seed)
    pixels = torch.rand(cams, 3, 16, 16, generator=g) * 2 - 1
    text = torch.randint(0, 290, (7,), generator=g)
    state = torch.randn(8, generator=g)
    noise = torch.randn(5, 8, generator=g)
    return pixels, text, state, noise


def test_pi0_sample_actions_equals_transformers(pair):
    hf, policy = pair
    pixels, text, state, noise = _inputs()
    patches = 16
    ids = torch.cat([torch.full((2 * patches,), IMAGE_TOKEN), text])[None]
    want = hf.sample_actions(state=state[None], input_ids=ids, pixel_values=pixels[None], noise=noise[None],
                             pixel_attention_mask=torch.ones(1, 2, dtype=torch.bool), num_steps=3,
                             # with a mask, positions are cumsum(mask) - 1 as openpi's (without one PaliGemma counts from 1)
                             attention_mask=torch.ones_like(ids))[0]
    with torch.inference_mode():
        image_tokens = policy.encode_images(pixels)
    got = reference.sample_actions(policy, image_tokens, text, noise, state=state, num_steps=3)
    assert (got - want).abs().max() <= 1e-4, (got - want).abs().max()
