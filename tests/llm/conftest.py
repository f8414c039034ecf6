"""Presets for the LLM tests are written under a per-session MSTAR_CACHE, never the user's cache."""

import os

import pytest


@pytest.fixture(scope="session")
def llm_cache(tmp_path_factory):
    old = os.environ.get("MSTAR_CACHE")
    os.environ["MSTAR_CACHE"] = str(tmp_path_factory.mktemp("mstar-llm-cache"))
    yield os.environ["MSTAR_CACHE"]
    if old is None:
        os.environ.pop("MSTAR_CACHE", None)
    else:
        os.environ["MSTAR_CACHE"] = old


@pytest.fixture(scope="session")
def tiny(llm_cache):
    from mstar_core.model import LoadOptions
    from mstar_llm import load_llm

    return load_llm(LoadOptions(preset="tiny"), progress=False)
