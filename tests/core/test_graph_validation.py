"""Every validation error is raised at build time and names the walk and the node."""

import pytest

from mstar_core.errors import GraphValidationError
from mstar_core.graph import (
    DynamicLoop,
    Graph,
    GraphNode,
    Loop,
    NodeCall,
    Parallel,
    Sequential,
    StreamingGraphEdge,
    Walk,
    to_dot,
    to_mermaid,
)
from mstar_core.streaming import FixedChunkPolicy, SlidingWindowChunkPolicy

A = GraphNode("a", inputs="x", outputs="y", engine="function")
B = GraphNode("b", inputs="y", outputs="z", engine="function")
C = GraphNode("c", inputs="z", outputs="x", engine="function")


def build(walk, nodes=(A, B, C)):
    return Graph.build("m", nodes, [walk])


def test_valid_graph_builds_and_derives_edges():
    g = build(Walk(name="w", body=Sequential("a", "b"), inputs="x", outputs="z"))
    edges = g.edges("w")
    assert [(e.src, e.src_output, e.dst, e.dst_input) for e in edges] == [("a", "y", "b", "y")]


def test_unknown_node_lists_known_nodes():
    with pytest.raises(GraphValidationError, match=r"\[walk 'w', node 'nope'\] unknown node 'nope'; known nodes: a, b, c"):
        build(Walk(name="w", body=Sequential("a", "nope"), inputs="x"))


def test_unconnected_input():
    with pytest.raises(GraphValidationError, match=r"node 'b'\] unconnected input 'y'"):
        build(Walk(name="w", body="b", inputs="x"))


def test_input_produced_later_asks_to_reorder():
    with pytest.raises(GraphValidationError, match="produced only later, by node 'a'; reorder"):
        build(Walk(name="w", body=Sequential("b", "a"), inputs="x"))


def test_cycle_outside_a_loop():
    # a needs x, made by c, which needs z from b, which needs y from a
    with pytest.raises(GraphValidationError, match=r"\[walk 'w', node 'a'\] cycle outside a loop"):
        build(Walk(name="w", body=Sequential("a", "b", "c"), inputs=()))


def test_same_cycle_inside_a_loop_is_fine():
    g = build(Walk(name="w", body=Loop(body=Sequential("a", "b", "c"), iters=3), inputs="x", outputs="x"))
    assert g.walks["w"].outputs == ("x",)


def test_duplicate_node_and_walk_names():
    with pytest.raises(GraphValidationError, match="duplicate node name 'a'"):
        Graph.build("m", [A, A], [Walk(name="w", body="a", inputs="x")])
    with pytest.raises(GraphValidationError, match="duplicate walk name 'w'"):
        Graph.build("m", [A], [Walk(name="w", body="a", inputs="x")] * 2)


def test_parallel_branches_writing_the_same_name():
    with pytest.raises(GraphValidationError, match="duplicate name 'y'.*branches 0 and 1"):
        build(Walk(name="w", body=Parallel("a", "a"), inputs="x"))
    g = build(Walk(name="w", body=Parallel("a", NodeCall("a", outputs={"y": "y2"})), inputs="x", outputs=("y", "y2")))
    assert set(g.walks["w"].outputs) == {"y", "y2"}


def test_loop_without_exit():
    with pytest.raises(GraphValidationError, match=r"node 'a'\] loop without exit: DynamicLoop needs an `until`"):
        build(Walk(name="w", body=DynamicLoop(body="a", until=None, max_iters=4), inputs="x"))
    with pytest.raises(GraphValidationError, match="needs a `max_iters` ceiling"):
        build(Walk(name="w", body=DynamicLoop(body="a", until=lambda env: True, max_iters=None), inputs="x"))


def test_streaming_edge_without_policy():
    edge = StreamingGraphEdge("a.y", "b.y", policy=None)
    with pytest.raises(GraphValidationError, match=r"node 'b'\] streaming edge a.y -> b.y has no chunk policy"):
        build(Walk(name="w", body=Loop(body="a", iters=2), inputs="x", streams=(edge,)))


def test_streaming_edge_ports_are_checked():
    edge = StreamingGraphEdge("a.nope", "b.y", policy=FixedChunkPolicy(1))
    with pytest.raises(GraphValidationError, match="source 'a.nope'"):
        build(Walk(name="w", body="a", inputs="x", streams=(edge,)))


def test_renamed_ports_must_exist_and_carry_needs_first_value():
    with pytest.raises(GraphValidationError, match="renames input 'q'"):
        build(Walk(name="w", body=NodeCall("a", inputs={"q": "x"}), inputs="x"))
    with pytest.raises(GraphValidationError, match="carry target 'x' has no value"):
        build(Walk(name="w", body=Loop(body=Sequential("c"), iters=2, carry={"x": "x"}), inputs="z"))


def test_emit_and_outputs_must_be_produced():
    with pytest.raises(GraphValidationError, match="emit names 'q'"):
        build(Walk(name="w", body="a", inputs="x", emit="q"))
    with pytest.raises(GraphValidationError, match="output 'z' is never produced"):
        build(Walk(name="w", body="a", inputs="x", outputs="z"))


def test_render_mermaid_and_dot():
    edge = StreamingGraphEdge("a.y", "b.y", policy=SlidingWindowChunkPolicy(28, 7))
    walk = Walk(
        name="w",
        body=DynamicLoop(body=Sequential("a", "c"), until=lambda env: True, max_iters=8, carry={}),
        inputs="x",
        streams=(edge,),
    )
    g = Graph.build("m", [A, B, GraphNode("c", inputs="y", outputs="x", engine="function")], [walk])
    mermaid = to_mermaid(g, "w")
    assert mermaid.startswith("flowchart TD")
    assert "SlidingWindowChunkPolicy(28, 7, drop)" in mermaid
    assert 'c0 -- "y" --> c1' in mermaid
    dot = to_dot(g, "w")
    assert dot.startswith('digraph "w"') and "subgraph cluster_g1" in dot and dot.rstrip().endswith("}")
    assert "c1 -> c0" in dot  # the loop's back edge: c writes x, which a reads next iteration
