"""A one-walk model served by the fixture engine."""

from mstar_core.graph import Graph, GraphNode, Walk
from mstar_core.model import LoadedModel, ModelSpec


def load(options):
    graph = Graph.build(
        "fixture-echo",
        [GraphNode("echo", inputs=("x",), outputs=("y",), engine="fixture_echo")],
        [Walk(name="echo", body="echo", inputs=("x",), outputs=("y",), emit=("y",))],
    )
    return LoadedModel(name="fixture-echo", graph=graph, random_weights=True)


SPEC = ModelSpec(name="fixture-echo", load=load, description="echoes its input (test fixture)")
