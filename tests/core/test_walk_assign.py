"""Walk-level copies and renames (`Assign`, `Copy`, `Rename`): checked at build, drawn, run by the conductor and by
a worker hosting a delegated loop; two Parallel branches running the same node need no glue node."""

from __future__ import annotations

import pytest
import torch
from mstar_fixture_plugin.rename import rename_graph

from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import Placement
from mstar_core.errors import GraphValidationError
from mstar_core.graph import (
    Assign,
    Copy,
    Graph,
    GraphNode,
    Loop,
    NodeCall,
    Parallel,
    Rename,
    Sequential,
    Walk,
    to_dot,
    to_mermaid,
)
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover

NODES = [GraphNode("scale", inputs="a", outputs="b", engine="function", module=lambda: lambda a: a * 10),
         GraphNode("sum", inputs=("p", "q"), outputs="s", engine="function", module=lambda: lambda p, q: p + q)]


def build(body, inputs=("x",), outputs=(), emit=()):
    return Graph.build("m", NODES, [Walk(name="w", body=body, inputs=inputs, outputs=outputs, emit=emit)])


def test_assign_spellings():
    assert Copy(y="x") == Assign({"y": "x"}) == Assign(y="x")
    assert Rename({"y": "x"}) == Assign(y="x", move=True)
    assert Rename(y="x").label == "Rename y = x" and Copy(y="x", z="w").label == "Copy y = x, z = w"
    with pytest.raises(ValueError, match="at least one target"):
        Assign()
    with pytest.raises(ValueError, match="non-empty strings"):
        Copy(y=3)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (Sequential(Copy(y="nope"), "scale"), r"Copy y = nope reads 'nope', which is not available where it runs; "
                                              r"available: \['x'\]"),
        (Sequential(NodeCall("scale", inputs={"a": "x"}), Rename(x="b")),
         "Rename x = b would overwrite 'x', which is already available there; .*replace=True"),
        # renamed away, the source is gone for later steps
        (Sequential(NodeCall("scale", inputs={"a": "x"}), Rename(c="b"), NodeCall("scale", inputs={"a": "b"})),
         r"unconnected input 'a' \(env 'b'\)"),
        # without renames, both branches write 'b'
        (Parallel(NodeCall("scale", inputs={"a": "x"}), NodeCall("scale", inputs={"a": "x"})),
         "duplicate name 'b': Parallel branches 0 and 1"),
    ],
)
def test_build_errors_name_the_step(body, match):
    with pytest.raises(GraphValidationError, match=match) as info:
        build(body)
    assert "walk 'w'" in str(info.value)


def test_branches_renaming_one_nodes_output_need_no_glue_node():
    graph = build(Sequential(Parallel(Sequential(NodeCall("scale", inputs={"a": "x"}), Rename(p="b")),
                                      Sequential(NodeCall("scale", inputs={"a": "x"}), Copy(q="b"))),
                             "sum"), outputs=("s", "p", "q"))
    # a data edge follows a copied value back to the node that produced it
    assert {(e.src, e.dst, e.dst_input) for e in graph.edges("w")} >= {("scale", "sum", "p"),
                                                                               ("scale", "sum", "q")}
    build(Sequential(NodeCall("scale", inputs={"a": "x"}), Rename(x="b", replace=True)), outputs="x")
    build(Sequential(Copy(y="x"), Loop(body=Sequential(NodeCall("scale", inputs={"a": "y"}), Rename(y="b", replace=True)),
                                       iters=2)), outputs="y")


def test_graph_renders_copies_and_renames():
    mermaid, dot = to_mermaid(rename_graph(), "run"), to_dot(rename_graph(), "run")
    for text in (mermaid, dot):
        assert "Copy v = x, v2 = x" in text and "Rename v = v2" in text and "Rename bx = b" in text
    assert '-- "b" -->' in mermaid  # scale's output flows into the rename


async def _run(placement=None):
    engine = placed_engine(discover())
    await engine.load_model("fixture-rename", LoadOptions(preset="tiny"), placement=placement)
    try:
        handle = engine.submit("fixture-rename", {"x": torch.tensor(1.0), "n": 3})
        emitted = [(out.name, out.walk, float(out.value)) async for out in handle]
        env = await handle.result()
        delegated = len(engine._models["fixture-rename"].conductor.remote_loops)
        return emitted, env, delegated
    finally:
        await engine.close()


async def test_copies_and_renames_run_in_process():
    emitted, env, _ = await _run()
    assert emitted == [("bv", "run", 40.0)]
    assert {k: float(v) for k, v in env.items() if k != "n"} == {"x": 1.0, "v": 4.0, "bx": 10.0, "bv": 40.0}
    assert "v2" not in env and "b" not in env  # moved away (in the loop, and inside each branch)


@pytest.mark.timeout(120)
async def test_copies_and_renames_in_a_loop_delegated_to_a_worker():
    placement = Placement.from_dict({"workers": {"w": {}}, "nodes": {"inc": "w"}})
    emitted, env, delegated = await _run(placement)
    assert delegated == 1
    assert emitted == [("bv", "run", 40.0)]
    assert {k: float(v) for k, v in env.items() if k != "n"} == {"x": 1.0, "v": 4.0, "bx": 10.0, "bv": 40.0}
    assert "v2" not in env
