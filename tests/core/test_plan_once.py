"""A request's plan is computed and checked once, at submission (issue 26.3): the conductor runs that plan."""

from __future__ import annotations

import pytest

from mstar_core.errors import RequestError
from mstar_core.graph import Graph, Walk
from mstar_core.model import LoadedModel
from mstar_core.plugins import discover
from mstar_core.runtime import AsyncEngine
from tests.core.helpers import fn_node


def _graph(calls: list[dict]) -> Graph:
    def plan(env):
        calls.append(dict(env))
        return ["double"]

    node = fn_node("twice", "x", "y", lambda x: 2 * x)
    walk = Walk(name="double", body="twice", inputs=("x",), outputs=("y",))
    return Graph.build("m", [node], [walk], plan=plan)


async def test_the_plan_is_computed_once_per_request_and_its_inputs_checked_before_it_starts():
    calls: list[dict] = []
    engine = AsyncEngine(discover())
    await engine.add_model(LoadedModel("m", _graph(calls)))
    try:
        assert (await engine.generate("m", {"x": 3}))["y"] == 6
        assert len(calls) == 1
        with pytest.raises(RequestError, match=r"needs inputs \['x'\]"):
            engine.submit("m", {"z": 1})
        assert len(calls) == 2  # refused at submission, before any walk ran
    finally:
        await engine.close()
