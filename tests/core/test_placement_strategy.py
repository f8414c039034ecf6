"""AsyncEngine places nodes on workers only through the strategy it is handed; it imports no cluster code."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mstar_core.config import Placement
from mstar_core.errors import ConfigError
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.runtime import AsyncEngine


def test_the_in_process_runtime_loads_no_cluster_module():
    code = ("import sys, mstar_core.runtime, mstar_core.api.server.app; "
            "print(sorted(m for m in sys.modules if m.startswith('mstar_core.cluster')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout


async def test_a_plain_engine_refuses_a_placement_that_names_workers_before_loading():
    engine = AsyncEngine(discover())
    spec = engine.registry.models.get("fixture-rename")
    loads = []
    original = spec.load
    object.__setattr__(spec, "load", lambda options: loads.append(options) or original(options))
    try:
        placement = Placement.from_dict({"workers": {"w": {}}, "nodes": {"inc": "w"}}, "p.yaml")
        with pytest.raises(ConfigError, match=r"p\.yaml: the placement puts nodes on workers.*placement_strategy="):
            await engine.load_model("fixture-rename", LoadOptions(preset="tiny"), placement=placement)
        assert loads == [] and engine.models == {} and engine.cluster is None
        # a placement that keeps every node here needs no strategy
        await engine.load_model("fixture-rename", LoadOptions(preset="tiny"), placement=Placement.from_dict({}, "p.yaml"))
        assert "fixture-rename" in engine.models
    finally:
        object.__setattr__(spec, "load", original)
        await engine.close()
