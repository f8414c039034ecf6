"""Shared tiny configs for the Orpheus tests."""

import pytest
import torch

TINY_SNAC = dict(
    sampling_rate=24000,
    encoder_dim=8,
    encoder_rates=[2, 2],
    decoder_dim=16,
    decoder_rates=[2, 2],
    attn_window_size=None,
    codebook_size=16,
    codebook_dim=4,
    vq_strides=[4, 2, 1],
    noise=True,
    depthwise=True,
)


@pytest.fixture
def reference_snac():
    """The `snac` package's model with seeded random weights (perturbed so every tensor matters)."""
    snac = pytest.importorskip("snac")
    torch.manual_seed(0)
    ref = snac.SNAC(**TINY_SNAC).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return ref
