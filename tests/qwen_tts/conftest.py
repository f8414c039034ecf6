"""Shared fixtures: the tiny preset, loaded by M* and (for fidelity) by the `qwen-tts` package from the same files."""

import pytest


@pytest.fixture(scope="session")
def tiny_dir(preset_cache):
    from mstar_qwen_tts.preset import ensure_tiny

    return ensure_tiny()


@pytest.fixture(scope="session")
def tts(tiny_dir):
    from mstar_qwen_tts.checkpoint import load_tts

    return load_tts(tiny_dir, progress=False)


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    from mstar_core.checkpoint import load_tokenizer

    return load_tokenizer(tiny_dir)
