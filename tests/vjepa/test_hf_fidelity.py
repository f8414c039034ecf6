"""Encoder and masked predictor match transformers' VJEPA2Model with the same tiny random weights (fp32)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mstar_vjepa.config import VJEPA2Config  # noqa: E402
from mstar_vjepa.predictor import VJEPA2Model  # noqa: E402

TINY = dict(
    crop_size=32, patch_size=16, frames_per_clip=4, tubelet_size=2, hidden_size=48, num_attention_heads=2,
    num_hidden_layers=2, mlp_ratio=2.0, pred_hidden_size=40, pred_num_attention_heads=2, pred_num_hidden_layers=2,
    pred_num_mask_tokens=4, pred_mlp_ratio=2.0,
)


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    hf_cfg = transformers.VJEPA2Config(**TINY, pred_zero_init_mask_tokens=False)
    hf = transformers.VJEPA2Model(hf_cfg).eval()
    with torch.no_grad():  # non-trivial biases and mask tokens so every parameter matters
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ours = VJEPA2Model(VJEPA2Config.from_dict(hf_cfg.to_dict())).eval()
    missing = ours.load_state_dict(hf.state_dict(), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    return hf, ours


def test_encoder_matches_hf(pair):
    hf, ours = pair
    video = torch.randn(2, 4, 3, 32, 32)
    with torch.no_grad():
        ref = hf(pixel_values_videos=video, skip_predictor=True).last_hidden_state
        got = ours.encode(video)
    assert got.shape == ref.shape == (2, 8, 48)
    assert (got - ref).abs().max().item() <= 1e-4


def test_single_image_is_repeated_into_a_tubelet(pair):
    hf, ours = pair
    image = torch.randn(1, 1, 3, 32, 32)
    with torch.no_grad():
        ref = hf(pixel_values_videos=image, skip_predictor=True).last_hidden_state
        got = ours.encode(image)
    assert (got - ref).abs().max().item() <= 1e-4


def test_predictor_full_coverage_matches_hf(pair):
    hf, ours = pair
    video = torch.randn(2, 4, 3, 32, 32)
    with torch.no_grad():
        ref = hf(pixel_values_videos=video).predictor_output.last_hidden_state
        got = ours.predict(ours.encode(video))
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-4


def test_predictor_with_context_and_target_masks_matches_hf(pair):
    hf, ours = pair
    video = torch.randn(2, 4, 3, 32, 32)
    ctx = [torch.tensor([[0, 2, 5, 7], [1, 3, 4, 6]])]
    tgt = [torch.tensor([[1, 3, 4], [0, 2, 7]])]
    with torch.no_grad():
        ref = hf(pixel_values_videos=video, context_mask=ctx, target_mask=tgt).predictor_output.last_hidden_state
        got = ours.predict(ours.encode(video), ctx, tgt)
    assert got.shape == ref.shape == (2, 3, 48)
    assert (got - ref).abs().max().item() <= 1e-4
