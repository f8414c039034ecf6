"""Session-wide test setup: presets go to a private cache, never the user's."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def preset_cache(tmp_path_factory):
    """Point MSTAR_CACHE at a per-session directory (server and worker subprocesses inherit it)."""
    old = os.environ.get("MSTAR_CACHE")
    os.environ["MSTAR_CACHE"] = str(tmp_path_factory.mktemp("mstar-cache"))
    yield os.environ["MSTAR_CACHE"]
    if old is None:
        os.environ.pop("MSTAR_CACHE", None)
    else:
        os.environ["MSTAR_CACHE"] = old
