"""Tiny AC world-model fixtures (seeded random weights)."""

import pytest
import torch
from mstar_vjepa.ac_predictor import ACPredictor
from mstar_vjepa.config import ACPredictorConfig

TINY_AC = dict(img_size=32, patch_size=16, num_frames=64, tubelet_size=2, embed_dim=32, predictor_embed_dim=32,
               depth=2, num_heads=2, mlp_ratio=2.0)


def randomized(module: torch.nn.Module, seed: int = 0, scale: float = 0.1) -> torch.nn.Module:
    """Perturb every parameter so biases and norms matter too."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return module.eval()


@pytest.fixture(scope="module")
def ac_predictor() -> ACPredictor:
    torch.manual_seed(0)
    return randomized(ACPredictor(ACPredictorConfig(**TINY_AC)))
