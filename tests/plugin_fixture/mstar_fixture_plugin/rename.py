"""A model whose walk copies and renames values (`Copy`, `Rename`), in a loop and in Parallel branches (tests)."""

from mstar_core.graph import Copy, Graph, GraphNode, Loop, NodeCall, Parallel, Rename, Sequential, Walk
from mstar_core.model import LoadedModel, ModelSpec


def inc(v):
    return v + 1


def scale(a):
    return a * 10


def rename_graph() -> Graph:
    nodes = [GraphNode("inc", inputs="v", outputs="v2", engine="function", module=lambda: inc),
             GraphNode("scale", inputs="a", outputs="b", engine="function", module=lambda: scale)]
    body = Sequential(
        Copy(v="x", v2="x"),  # the loop works on v; x survives it; v2 is moved away by every iteration
        Loop(body=Sequential("inc", Rename(v="v2", replace=True)), iters="n"),
        # the same node in both branches writes `b`: each branch renames it to its own name
        Parallel(Sequential(NodeCall("scale", inputs={"a": "x"}), Rename(bx="b")),
                 Sequential(NodeCall("scale", inputs={"a": "v"}), Rename(bv="b"))),
    )
    walk = Walk(name="run", body=body, inputs=("x", "n"), outputs=("x", "v", "bx", "bv"), emit=("bv",))
    return Graph.build("fixture-rename", nodes, [walk])


def load(options):
    return LoadedModel(name="fixture-rename", graph=rename_graph(), random_weights=True)


SPEC = ModelSpec(name="fixture-rename", load=load, description="copies and renames values in its walk (test fixture)",
                 example={"x": 1.0, "n": 3})
