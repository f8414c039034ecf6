"""A node reading, read-only, the pages another node of the same model wrote (pi0.5's expert over the VLM prefix)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mstar_core.errors import GraphValidationError, ModelLoadError
from mstar_core.graph import Graph, GraphNode, NodeCall, Sequential, Walk
from mstar_core.runtime.engine import EngineContext, Invocation, build_order
from tests.engines.paged_tiny import TinyNode, drain

PREFIX, SUFFIX = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [30, 31, 32, 33, 34]


def _graph(expert_kv_heads: int = 2, share: str = "vlm") -> tuple[Graph, dict]:
    modules = {"vlm": TinyNode(seed=0), "expert": TinyNode(seed=1, kv_heads=expert_kv_heads)}
    vlm = GraphNode("vlm", inputs=("input_ids",), outputs=("hidden",), engine="kvcache", module=lambda: modules["vlm"])
    expert = GraphNode("expert", inputs=("input_ids",), outputs=("velocity",), engine="kvcache",
                       module=lambda: modules["expert"], options={"share_cache_with": share})
    walk = Walk(name="act", inputs=("prefix", "suffix"), outputs=("velocity",), body=Sequential(
        NodeCall("vlm", inputs={"input_ids": "prefix"}, options={"bidirectional": True}),
        NodeCall("expert", inputs={"input_ids": "suffix"}, options={"write_cache": False, "bidirectional": True}),
    ))
    return Graph.build("pi-tiny", [vlm, expert], [walk]), modules


def _engines(graph: Graph, modules: dict, worker: str = "w0") -> dict:
    from mstar_kvcache import KVCacheEngine

    engines = {}
    for name in build_order(graph, graph.nodes):  # the owner of the pool first, as the runtime builds them
        ctx = EngineContext(worker, torch.device("cpu"), {"page_size": 4, "num_pages": 32}, peers=dict(engines))
        engines[name] = KVCacheEngine(graph.nodes[name], modules[name], ctx)
    return engines


class _Record:
    """Dense bidirectional attention that keeps each layer's keys and values."""

    def __init__(self):
        self.kv = {}

    def attend(self, layer, q, k, v, scale):
        self.kv[layer] = (k, v)
        return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=scale,
                                              enable_gqa=True).transpose(0, 1)


class _Joint:
    """The expert's queries over [the VLM's keys of that layer; its own], all visible."""

    def __init__(self, record):
        self.record = record

    def attend(self, layer, q, k, v, scale):
        pk, pv = self.record.kv[layer]
        keys, vals = torch.cat((pk, k)), torch.cat((pv, v))
        return F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1),
                                              scale=scale, enable_gqa=True).transpose(0, 1)


def test_second_node_reading_the_first_nodes_pages_equals_one_joint_forward():
    graph, modules = _graph()
    engines = _engines(graph, modules)
    vlm, expert = engines["vlm"], engines["expert"]
    assert vlm.pool is expert.pool
    vlm.add(Invocation("r", "vlm", {"input_ids": PREFIX}, {"bidirectional": True}))
    drain(vlm)
    used = vlm.pool.num_used
    expert.add(Invocation("r", "expert", {"input_ids": SUFFIX}, {"write_cache": False, "bidirectional": True}))
    got = drain(expert)["r"]["velocity"]
    assert vlm.pool.num_used == used and not expert.active_requests()
    record = _Record()
    with torch.no_grad():
        modules["vlm"](torch.tensor(PREFIX), torch.arange(len(PREFIX)), record)
        hidden = modules["expert"](torch.tensor(SUFFIX), torch.arange(len(PREFIX), len(PREFIX) + len(SUFFIX)),
                                   _Joint(record))
        want = modules["expert"].compute_velocity(hidden)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # the prefix stays the VLM's: released there, the pages go back (the reader held none after its call)
    vlm.release("r")
    expert.release("r")
    assert vlm.pool.num_used == 0


def test_shapes_must_agree_at_load():
    graph, modules = _graph(expert_kv_heads=1)
    with pytest.raises(ModelLoadError, match="kv_heads 1 vs 2|kv_heads 2 vs 1"):
        _engines(graph, modules, worker="w-mismatch")


def test_share_cache_with_must_name_a_kvcache_node():
    with pytest.raises(GraphValidationError, match="share_cache_with='vln'"):
        _graph(share="vln")


def test_a_missing_label_of_the_partner_fails_the_call():
    graph, modules = _graph()
    engines = _engines(graph, modules, worker="w-missing")
    engines["expert"].add(Invocation("r", "expert", {"input_ids": SUFFIX}, {"write_cache": False}))
    (inv, res), = engines["expert"].step()
    assert "holds no cache label" in str(res)


def test_the_runtime_builds_the_owner_first_and_each_load_gets_its_own_pool():
    from mstar_core.model import LoadedModel
    from mstar_core.runtime import AsyncEngine

    graph, modules = _graph()
    # the reader listed first: the runtime still builds the pool's owner ('vlm') before it
    graph = Graph.build("pi-tiny", [graph.nodes["expert"], graph.nodes["vlm"]], list(graph.walks.values()))
    assert build_order(graph, graph.nodes) == ["vlm", "expert"]

    async def go():
        async with AsyncEngine() as engine:
            for alias in ("a", "b"):
                await engine.add_model(LoadedModel("pi-tiny", graph), alias=alias)
            a, b = engine.node_engines("a"), engine.node_engines("b")
            assert a["expert"].pool is a["vlm"].pool and b["expert"].pool is b["vlm"].pool
            assert a["vlm"].pool is not b["vlm"].pool  # the same model loaded twice shares nothing
            out = await engine.submit("a", {"prefix": PREFIX, "suffix": SUFFIX}).result()
            assert out["velocity"].shape[0] == len(SUFFIX) and a["vlm"].pool.num_used == 0

    import asyncio

    asyncio.run(go())


def test_a_reader_without_its_owner_in_the_process_fails_at_load():
    from mstar_kvcache import KVCacheEngine

    graph, modules = _graph()
    ctx = EngineContext("w0", torch.device("cpu"), {"page_size": 4, "num_pages": 32})
    with pytest.raises(ModelLoadError, match="node 'expert'.*shares the KV cache of node 'vlm', which is not built"):
        KVCacheEngine(graph.nodes["expert"], modules["expert"], ctx)
