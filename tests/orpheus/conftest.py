"""Shared fixtures for the Orpheus tests."""

import pytest
import torch

from tests.orpheus.helpers import TINY_SNAC


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
