"""`mstar graph` draws call options read from the env as what they compute, not as a Python repr."""

from mstar_core.graph import FromEnv, Graph, GraphNode, Loop, NodeCall, Parallel, Walk, to_dot, to_mermaid


def label_of(i):
    return f"step{i}"


def test_from_env_options_are_drawn_readably():
    node = GraphNode("f", inputs="a", outputs="b", engine="function", module=lambda: lambda a: a)
    call = NodeCall("f", options={"label": FromEnv("choice", "c{}"), "seed": FromEnv("choice"),
                                  "pad": FromEnv("loop_index", "s{:03d}"), "named": FromEnv("loop_index", label_of),
                                  "fixed": "main"})
    walk = Walk(name="w", body=Parallel(Loop(body=call, iters=2), count=2, index_name="choice"), inputs=("a",))
    graph = Graph.build("g", [node], [walk])
    for text in (to_mermaid(graph, "w"), to_dot(graph, "w")):
        assert "FromEnv" not in text and "derive=" not in text
        assert "label=c{$choice}, seed=$choice, pad=s{$loop_index:03d}, named=label_of($loop_index), fixed=main" in text
