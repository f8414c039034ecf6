"""The `diffusion` engine's options: a misspelt one fails `Graph.build`; a call's settings are checked at every call."""

from __future__ import annotations

import pytest
import torch
from mstar_diffusion import DiffusionEngine
from mstar_diffusion.params import CALL_OPTIONS, KNOWN_OPTIONS
from mstar_diffusion.schedules import flow_euler

from mstar_core.errors import GraphValidationError, RequestError
from mstar_core.graph import Graph, GraphNode, Loop, NodeCall, Sequential, Walk
from mstar_core.graph.options import known_call_options
from mstar_core.runtime.engine import EngineContext, Invocation


def _euler_node(**options) -> GraphNode:
    return GraphNode("euler", engine="diffusion", inputs=("latents", "step", "num_steps", "velocity"),
                     optional_inputs=("velocity_uncond", "guidance_scale", "shift"), outputs=("latents", "sigma"),
                     options=options)


def _graph(call_options: dict, **node_options) -> Graph:
    velocity = GraphNode("velocity_model", engine="stateless", inputs=("latents",), outputs=("velocity",))
    walk = Walk(name="denoise", inputs=("latents", "num_steps"), outputs=("latents",),
                optional_inputs=("velocity_uncond", "guidance_scale", "shift"),
                body=Loop(body=Sequential(NodeCall("velocity_model"),
                                          NodeCall("euler", inputs={"step": "loop_index"}, options=call_options)),
                          iters="num_steps"))
    return Graph.build("m", [velocity, _euler_node(**node_options)], [walk])


def _engine(node: GraphNode) -> DiffusionEngine:
    return DiffusionEngine(node, None, EngineContext("w", torch.device("cpu"), {}))


def _run(engine: DiffusionEngine, *invocations: Invocation) -> list:
    """Each invocation's result, in the order given."""
    for inv in invocations:
        engine.add(inv)
    results = {}
    while engine.has_work():
        results.update((inv.request_id, out) for inv, out in engine.step())
    return [results[inv.request_id] for inv in invocations]


def test_the_engine_declares_its_options_for_graph_build():
    assert known_call_options("diffusion") == KNOWN_OPTIONS and CALL_OPTIONS < KNOWN_OPTIONS
    assert _graph({"guidance_scale": 2.0, "shift": 3.0}, schedule="flow_euler").nodes["euler"].engine == "diffusion"


def test_a_misspelt_call_option_fails_graph_build_naming_walk_node_and_options():
    with pytest.raises(GraphValidationError) as err:
        _graph({"guidance_sacle": 2.0})
    msg = str(err.value)
    assert "walk 'denoise'" in msg and "node 'euler'" in msg and "guidance_sacle" in msg and "'guidance_scale'" in msg


def test_a_misspelt_node_option_fails_graph_build():
    with pytest.raises(GraphValidationError, match="sheduler") as err:
        _graph({}, sheduler="flow_euler")
    assert "'schedule'" in str(err.value)


def test_a_call_site_cannot_set_what_the_engine_reads_once_at_load():
    # `schedule` is a node option: per call it would be silently ignored, so the engine refuses the walk at load
    graph = _graph({"schedule": "flow_euler"})
    with pytest.raises(GraphValidationError) as err:
        _engine(graph.nodes["euler"])
    assert "walk 'denoise'" in str(err.value) and "schedule" in str(err.value) and "'num_steps'" in str(err.value)


def test_steady_steps_follow_the_schedule_whatever_the_options_object():
    engine = _engine(_euler_node(shift=3.0))
    x, v = torch.randn(4, 5), torch.randn(4, 5)
    sigmas = flow_euler(6, 3.0).float()
    for step in range(6):  # the node's own options view, then per-call plain dicts (options resolved from the env)
        options = engine.node.options if step % 2 else {"shift": 3.0}
        (out,) = _run(engine, Invocation("r", "euler", {"latents": x, "step": step, "num_steps": 6, "velocity": v},
                                         options))
        expected = x + (sigmas[step + 1] - sigmas[step]) * v
        assert torch.equal(out["latents"], expected) and out["sigma"] == float(sigmas[step + 1])
        x = out["latents"]


@pytest.mark.parametrize("field, good, bad", [
    ("num_steps", 1, True),  # equal to 1 and hashing alike, but a bool is not a count
    ("num_steps", 2, 2.0),
    ("guidance_scale", 1.0, -1.0),
    ("shift", 1.0, float("nan")),
])
def test_a_bad_value_is_refused_at_every_call_even_after_an_equal_good_one(field, good, bad):
    engine = _engine(_euler_node())
    base = {"latents": torch.zeros(2, 3), "step": 0, "num_steps": 2, "velocity": torch.ones(2, 3)}
    first, *refused = _run(engine, *(Invocation(f"r{i}", "euler", base | {field: value}, {})
                                     for i, value in enumerate((good, bad, bad))))
    assert isinstance(first, dict)
    for out in refused:
        assert isinstance(out, RequestError) and out.status == 400 and out.param == field, out
