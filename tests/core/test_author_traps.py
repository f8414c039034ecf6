"""Traps a model author met writing a plugin from the docs (issue 13), each now caught or fixed."""

from __future__ import annotations

import pytest

from mstar_core.errors import GraphValidationError
from mstar_core.graph import DynamicLoop, Graph, GraphNode, NodeCall, Sequential, StreamingGraphEdge, Walk
from mstar_core.streaming import FixedChunkPolicy

ENCODER = GraphNode("encoder", inputs="image", outputs="features", engine="function")
DECODER = GraphNode("decoder", inputs="prompt", optional_inputs="features", outputs="text", engine="function")


def test_optional_input_nothing_supplies_is_a_build_error_naming_walk_node_and_input():
    # A typo in the rename: 'feature' is produced by nothing, so every caption would ignore the image.
    walk = Walk(name="caption", body=Sequential("encoder", NodeCall("decoder", inputs={"features": "feature"})),
                inputs=("image", "prompt"))
    with pytest.raises(GraphValidationError) as err:
        Graph.build("m", [ENCODER, DECODER], [walk])
    message = str(err.value)
    assert "caption" in message and "decoder" in message and "'features'" in message and "'feature'" in message
    assert "optional_inputs" in message


def test_optional_input_produced_only_after_its_reader_is_a_build_error():
    walk = Walk(name="caption", body=Sequential("decoder", "encoder"), inputs=("image", "prompt"))
    with pytest.raises(GraphValidationError, match="produced only later, by node 'encoder'"):
        Graph.build("m", [ENCODER, DECODER], [walk])


def test_optional_input_from_an_earlier_step_or_declared_on_the_walk_builds():
    with_image = Walk(name="caption", body=Sequential("encoder", "decoder"), inputs=("image", "prompt"))
    text_only = Walk(name="text", body="decoder", inputs="prompt", optional_inputs="features")
    graph = Graph.build("m", [ENCODER, DECODER], [with_image, text_only])
    assert graph.walks["text"].optional_inputs == ("features",)


def test_optional_input_fed_back_by_a_later_call_of_the_same_loop_builds():
    step = GraphNode("step", inputs="x", optional_inputs="state", outputs=("y", "done"), engine="function")
    update = GraphNode("update", inputs="y", outputs="state", engine="function")
    loop = DynamicLoop(body=Sequential("step", "update"), until=lambda env: env["done"], max_iters=4)
    Graph.build("m", [step, update], [Walk(name="w", body=loop, inputs="x")])


def test_streaming_consumer_takes_an_optional_input_only_where_the_walk_declares_it():
    # walk-scoped (issue 26): undeclared, the per-chunk call leaves it out; declared, it takes it
    producer = GraphNode("lm", inputs="ids", outputs="token", engine="function")
    codec = GraphNode("codec", inputs="codes", optional_inputs="noise_seed", outputs="audio", engine="function")
    stream = StreamingGraphEdge("lm.token", "codec.codes", FixedChunkPolicy(2))
    undeclared = Walk(name="speak", body="lm", inputs="ids", streams=[stream])
    assert Graph.build("m", [producer, codec], [undeclared]).bindings["speak"][(1,)] == ()
    declared = Walk(name="speak", body="lm", inputs="ids", optional_inputs="noise_seed", streams=[stream])
    assert Graph.build("m", [producer, codec], [declared]).bindings["speak"][(1,)] == ("noise_seed",)


def test_hookimpl_imports_from_the_package_root_as_the_hookspecs_docstring_says():
    import mstar_core
    import mstar_core.plugins.hookspecs as hookspecs
    from mstar_core import hookimpl

    assert hookimpl is hookspecs.hookimpl
    assert "mstar_core.hookimpl" in hookspecs.__doc__
    assert hasattr(mstar_core, "hookimpl")
