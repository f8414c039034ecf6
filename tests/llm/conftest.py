"""The tiny Llama preset, loaded once per session (into the private cache of tests/conftest.py)."""

import pytest


@pytest.fixture(scope="session")
def tiny(preset_cache):
    from mstar_core.model import LoadOptions
    from mstar_llm import load_llm

    return load_llm(LoadOptions(preset="tiny"), progress=False)
