"""Shared fixtures: the tiny preset, loaded by M* and by transformers (the oracle) from the same files."""

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_dir(preset_cache):
    from mstar_qwen_omni.preset import ensure_tiny

    return ensure_tiny()


@pytest.fixture(scope="session")
def omni(tiny_dir):
    from mstar_qwen_omni.checkpoint import load_omni

    return load_omni(tiny_dir, progress=False)


@pytest.fixture(scope="session")
def hf(tiny_dir):
    transformers = pytest.importorskip("transformers")
    model = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.float32)
    return model.eval()
