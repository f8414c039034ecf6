"""What a node declares is checked at load: call options, inputs, outputs; per-token nodes never sample."""

from __future__ import annotations

import mstar_kvcache  # noqa: F401  (declares the engine's call options, so Graph.build checks them)
import pytest
import torch

from mstar_core.errors import GraphValidationError, ModuleContractError, RequestError
from mstar_core.graph import Graph, GraphNode, NodeCall, Walk
from mstar_core.runtime.engine import Invocation
from tests.engines.paged_tiny import ROW_NODE, TinyNode, dense, engine_for, run


def test_a_misspelt_call_option_fails_graph_build_naming_walk_node_and_options():
    node = GraphNode("llm", inputs=("input_ids",), outputs=("hidden",), engine="kvcache")
    walk = Walk(name="image_gen", inputs=("ids",), body=NodeCall("llm", inputs={"input_ids": "ids"},
                                                                 options={"cache_lable": "cfg_text"}))
    with pytest.raises(GraphValidationError) as err:
        Graph.build("m", [node], [walk])
    msg = str(err.value)
    assert "walk 'image_gen'" in msg and "node 'llm'" in msg and "cache_lable" in msg and "'cache_label'" in msg


def test_the_engine_checks_call_sites_at_load_too():
    # a graph built before the plugin declared its options: the engine sees the call sites on its node
    node = GraphNode("llm", inputs=("input_ids",), outputs=("hidden",), engine="kvcache",
                     call_sites=(("prefill", {"cache_label": "main"}), ("decode", {"writecache": False})))
    with pytest.raises(GraphValidationError) as err:
        engine_for(TinyNode(), node)
    assert "walk 'decode'" in str(err.value) and "writecache" in str(err.value) and "write_cache" in str(err.value)


def test_an_unknown_option_on_a_call_is_that_calls_error():
    engine = engine_for(TinyNode())
    engine.add(Invocation("r", "dit", {"input_ids": [1, 2]}, {"cache_lable": "x"}))
    (_, res), = engine.step()
    assert isinstance(res, RequestError) and "cache_lable" in str(res)


def test_undeclared_inputs_and_outputs_fail_the_load():
    node = GraphNode("dit", inputs=("input_ids", "latents"), outputs=("hidden",), engine="kvcache")
    with pytest.raises(ModuleContractError, match="latents"):
        engine_for(TinyNode(), node)
    node = GraphNode("dit", inputs=("input_ids",), outputs=("flow",), engine="kvcache")
    with pytest.raises(ModuleContractError, match="compute_flow"):
        engine_for(TinyNode(), node)
    node = GraphNode("dit", inputs=("input_ids",), outputs=("finish_reason",), engine="kvcache")
    with pytest.raises(ModuleContractError, match="next_token"):
        engine_for(TinyNode(), node)


def test_per_token_outputs_never_touch_the_vocabulary():
    module = TinyNode()
    module.compute_logits = None  # a node without next_token must not need it
    engine = engine_for(module)
    out = run(engine, "r", {"input_ids": [1, 2, 3, 4, 5]})
    assert set(out) == {"hidden", "velocity"} and out["hidden"].shape == (5, 32) and out["velocity"].shape == (5, 4)
    out = run(engine, "r", {"input_ids": [6, 7, 8], "output_index": torch.tensor([0, 2])})
    torch.testing.assert_close(out["hidden"], dense(module, [1, 2, 3, 4, 5, 6, 7, 8])[[5, 7]], atol=1e-5, rtol=0)
    assert ROW_NODE.outputs == ("hidden", "velocity")
