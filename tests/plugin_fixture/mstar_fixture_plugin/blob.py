"""A tensor-heavy model for transport tests and benchmarks: one node that returns `x + 1`."""

from mstar_core.graph import Graph, GraphNode, Walk
from mstar_core.model import LoadedModel, ModelSpec


def add_one(x):
    if isinstance(x, str) and x == "unsendable":  # an output no wire format carries (for the worker tests)
        return {"y": {1, 2}}
    if isinstance(x, str) and x == "reject":  # the client's mistake, found inside the node (status must survive)
        from mstar_core.errors import RequestError

        raise RequestError("x must be a number, not 'reject'", status=422)
    return {"y": x + 1}


def load(options):
    nodes = [GraphNode("bump", inputs="x", outputs="y", engine="function", module=lambda: add_one)]
    walk = Walk(name="bump", body="bump", inputs=("x",), outputs=("y",))
    return LoadedModel(name="fixture-blob", graph=Graph.build("fixture-blob", nodes, [walk]), random_weights=True)


SPEC = ModelSpec(name="fixture-blob", load=load, description="returns its tensor input plus one (test fixture)")
