"""A node's engine is explicit: no silent `function` default, and `mstar graph` shows each node's engine."""

from __future__ import annotations

import pytest

from mstar_core.errors import GraphValidationError
from mstar_core.graph import Graph, GraphNode, Sequential, Walk, to_dot, to_mermaid


def test_a_node_without_engine_is_an_error_naming_it_and_the_usual_kinds():
    with pytest.raises(GraphValidationError) as err:
        GraphNode("encoder", inputs="video", outputs="latents")
    message = str(err.value)
    assert err.value.node == "encoder" and "node 'encoder'" in message and "engine=" in message
    for kind in ("'kvcache'", "'stateless'", "'function'", "plugin"):
        assert kind in message


@pytest.mark.parametrize("bad", [None, "", 3])
def test_an_empty_or_non_string_engine_is_an_error(bad):
    with pytest.raises(GraphValidationError, match="node 'n'"):
        GraphNode("n", inputs="x", outputs="y", engine=bad)


def test_mermaid_and_dot_label_each_call_with_its_engine():
    nodes = [
        GraphNode("enc", inputs="pixels", outputs="embeds", engine="stateless"),
        GraphNode("lm", inputs="embeds", outputs="token", engine="kvcache"),
        GraphNode("glue", inputs="token", outputs="text", engine="function"),
    ]
    graph = Graph.build("m", nodes, [Walk(name="w", body=Sequential("enc", "lm", "glue"), inputs="pixels", outputs="text")])
    mermaid, dot = to_mermaid(graph, "w"), to_dot(graph, "w")
    for label in ("enc [stateless]", "lm [kvcache]", "glue [function]"):
        assert label in mermaid and label in dot
