"""Real sizes build (on the meta device) with the published parameter counts."""

import pytest
import torch
from mstar_vjepa.ac_predictor import ACPredictor
from mstar_vjepa.config import VIT_SIZES, ACPredictorConfig, VJEPA2Config
from mstar_vjepa.encoder import VJEPA2Encoder


def _params(module):
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize(("size", "billions"), [("vitl", 0.30), ("vith", 0.63), ("vitg", 1.01)])
def test_encoder_sizes(size, billions):
    with torch.device("meta"):
        enc = VJEPA2Encoder(VJEPA2Config(**VIT_SIZES[size], crop_size=256))
    assert abs(_params(enc) / 1e9 - billions) < 0.03


def test_ac_predictor_size_and_window():
    cfg = ACPredictorConfig()
    with torch.device("meta"):
        pred = ACPredictor(cfg)
    assert 0.28 < _params(pred) / 1e9 < 0.33  # ~300M
    assert cfg.max_frames == 32 and cfg.tokens_per_frame == 256
