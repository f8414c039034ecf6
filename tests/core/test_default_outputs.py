"""Without `outputs`, a request's answer holds the declared outputs of the walks it ran, each once (issue 13):
not values of walks it never ran that happen to share a name with what is in its env."""

from __future__ import annotations

import json
import time

import pytest
import torch

from mstar_core.graph import Graph, GraphNode, Walk
from mstar_core.model import LoadedModel, ModelSpec
from mstar_core.plugins import hookimpl
from mstar_core.schema import RequestField, RequestSchema

PLUGIN = __name__


def _graph() -> Graph:
    nodes = [GraphNode("double", inputs="x", outputs="y", engine="function", module=lambda: lambda x: x * 2),
             GraphNode("negate", inputs="x", outputs="x", engine="function", module=lambda: lambda x: -x),
             GraphNode("sum", inputs="y", outputs="total", engine="function", module=lambda: lambda y: y.sum())]
    walks = [Walk(name="encode", body="double", inputs="x", outputs="y"),
             Walk(name="reduce", body="sum", inputs="y", outputs=("total", "y")),
             Walk(name="negate", body="negate", inputs="x", outputs="x")]  # never run by the plans below
    return Graph.build("two-walks", nodes, walks,
                       plan=lambda env: ["encode", "reduce"] if env.get("reduce") else ["encode"])


def _load(_options) -> LoadedModel:
    schema = RequestSchema(fields=(RequestField("x", "tensor", required=True, check=lambda t, _: t.float()),
                                   RequestField("reduce", "boolean", default=False)))
    return LoadedModel("two-walks", _graph(), request_schema=schema)


@hookimpl
def mstar_register_models(register):
    register(ModelSpec(name="two-walks", load=_load, example={"x": [1.0, 2.0]}))


def test_graph_declared_outputs_of_the_walks_run():
    graph = _graph()
    assert graph.declared_outputs(["encode"]) == ["y"]
    assert graph.declared_outputs(["encode", "reduce"]) == ["y", "total"]


async def test_handle_reports_the_walks_it_ran():
    from mstar_core.runtime import AsyncEngine

    async with AsyncEngine() as engine:
        await engine.add_model(_load(None))
        handle = engine.submit("two-walks", {"x": torch.ones(2), "reduce": True})
        await handle.result()
        assert handle.walks == ["encode", "reduce"]


def test_native_done_event_holds_only_the_walks_run():
    from fastapi.testclient import TestClient

    from mstar_core.api.server.app import ModelToServe, ServerConfig, create_app
    from mstar_core.model import LoadOptions
    from mstar_core.plugins.manager import discover
    from mstar_core.runtime import AsyncEngine

    registry = discover(extra_modules=[PLUGIN])
    config = ServerConfig(models=[ModelToServe("two-walks", LoadOptions())])
    with TestClient(create_app(config, lambda: AsyncEngine(registry))) as client:
        deadline = time.monotonic() + 30
        while client.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        out = client.post("/v1/walks/two-walks", json={"inputs": {"x": [1.0, 2.0]}, "stream": False}).json()
        assert set(out["outputs"]) == {"y"}, out  # "x" is in the env, but walk "negate" never ran
        lines = [json.loads(ln) for ln in client.post("/v1/walks/two-walks", json={
            "inputs": {"x": [1.0, 2.0], "reduce": True}}).text.splitlines()]
        assert list(lines[-1]["outputs"]) == ["y", "total"], lines[-1]


def test_mstar_run_writes_and_lists_each_output_once(tmp_path, capsys):
    from mstar_core.cli import main

    out = tmp_path / "outputs.json"
    assert main(["run", "two-walks", "--plugin", PLUGIN, "--inputs", '{"x": [1.0, 2.0], "reduce": true}',
                 "--out", str(out), "--no-progress"]) == 0
    assert list(json.loads(out.read_text())) == ["y", "total"]
    # the summary line named 'y' twice (declared by both walks) and 'x' (walk 'negate', never run)
    assert capsys.readouterr().out.strip().endswith(f"wrote {out}: outputs y, total")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
