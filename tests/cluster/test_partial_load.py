"""Workers load only the weights of the nodes they host: the codec-only Orpheus worker holds no LM parameter."""

import asyncio
import time
from pathlib import Path

import attrs
import pytest
from torch import nn

from mstar_core.checkpoint.partial import node_module, release_unhosted, resident_parameters
from mstar_core.config import load_placement
from mstar_core.model import LoadOptions

pytest.importorskip("mstar_orpheus")
pytestmark = pytest.mark.timeout(180)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "placement"


def _orpheus(nodes):
    from mstar_orpheus.model import load_orpheus

    loaded = load_orpheus(LoadOptions(preset="tiny", nodes=nodes), progress=False)
    return {name: resident_parameters([node_module(node)])["parameters"] for name, node in loaded.graph.nodes.items()}


def test_orpheus_builds_the_nodes_it_does_not_host_on_the_meta_device():
    full = _orpheus(None)
    assert full["lm"] > 0 and full["snac"] > 0
    assert _orpheus(("snac",)) == {"lm": 0, "snac": full["snac"]}
    assert _orpheus(("lm",)) == {"lm": full["lm"], "snac": 0}


def test_device_for_names_meta_for_nodes_hosted_elsewhere():
    options = LoadOptions(device="cuda:1", nodes=["snac"])
    assert options.nodes == ("snac",)
    assert options.device_for("snac") == "cuda:1" and options.device_for("lm") == "meta"
    assert options.device_for("lm", "snac") == "cuda:1"  # a module two nodes share, one of them hosted
    assert LoadOptions(device="cpu").device_for("anything") == "cpu"


class _Node:
    def __init__(self, module):
        self.module = lambda: module


class _Graph:
    def __init__(self, **modules):
        self.nodes = {name: _Node(module) for name, module in modules.items()}


def test_release_unhosted_frees_other_nodes_but_never_a_shared_module():
    shared = nn.Linear(4, 4)
    graph = _Graph(a=nn.Linear(3, 3), b=nn.Sequential(shared), c=nn.Sequential(shared, nn.Linear(4, 2)),
                   d=nn.Linear(2, 2))
    released = release_unhosted(graph, ["a", "b"])
    assert released == ["d"]  # c shares b's Linear: freeing it would take b's weights
    assert all(p.is_meta for p in graph.nodes["d"].module().parameters())
    assert not any(p.is_meta for name in "abc" for p in graph.nodes[name].module().parameters())
    counts = resident_parameters(graph.nodes[n].module() for n in "abcd")
    assert counts["parameters"] == 3 * 3 + 3 + 4 * 4 + 4 + 4 * 2 + 2  # the shared Linear counted once
    assert counts["parameter_bytes"] == 4 * counts["parameters"]


async def _heartbeat_with(state, key, timeout=20.0):
    deadline = time.monotonic() + timeout
    while key not in state.load:
        assert time.monotonic() < deadline, f"no heartbeat from {state.name} reported {key!r}"
        await asyncio.sleep(0.05)
    return state.load[key]


async def test_disaggregated_orpheus_codec_worker_holds_no_lm_parameter():
    from mstar_core.cluster.strategy import placed_engine
    from mstar_core.plugins import discover

    full = _orpheus(None)
    engine = placed_engine(discover())
    try:
        await engine.load_model("orpheus", LoadOptions(preset="tiny"),
                                placement=load_placement(EXAMPLES / "orpheus-disaggregated.yaml"))
        codec, lm = engine.cluster.workers["codec"], engine.cluster.workers["lm"]
        codec_total = await _heartbeat_with(codec, "process")
        lm_total = await _heartbeat_with(lm, "process")
        # every parameter the codec process holds is the codec's: none of the LM's
        assert codec_total["parameters"] == full["snac"]
        assert (await _heartbeat_with(codec, "orpheus/snac"))["parameters"] == full["snac"]
        assert lm_total["parameters"] == full["lm"]
        assert (await _heartbeat_with(lm, "orpheus/lm"))["parameters"] == full["lm"]
        # and the serving process holds none at all (every node runs in a worker)
        graph = engine.models["orpheus"].graph
        assert resident_parameters(node_module(n) for n in graph.nodes.values())["parameters"] == 0
        # the gauge reaches the engine's node stats (and so /metrics) per worker
        stats = {(node, worker): s for node, worker, s in engine.node_stats("orpheus")}
        assert stats["snac", "codec"]["parameters"] == full["snac"]
    finally:
        await engine.close()


async def test_a_serving_process_hosting_one_node_loads_only_that_node():
    from mstar_core.cluster.strategy import placed_engine
    from mstar_core.config.placement import Placement
    from mstar_core.plugins import discover

    full = _orpheus(None)
    placement = Placement.from_dict({"workers": {"codec": {"device": "cpu"}}, "nodes": {"snac": "codec"},
                                     "engine_settings": {"lm": {"num_pages": 64}}})
    engine = placed_engine(discover())
    spec = engine.registry.models.get("orpheus")
    builds = []  # the serving process builds the model once (it used to build it on meta first, then again)

    def load(options):
        builds.append(options)
        return spec.load(options)

    engine.registry.models._items["orpheus"] = attrs.evolve(spec, load=load)
    try:
        await engine.load_model("orpheus", LoadOptions(preset="tiny"), placement=placement)
        assert [(o.device, o.remote) for o in builds] == [("cpu", ("snac",))]
        graph = engine.models["orpheus"].graph
        here = {name: resident_parameters([node_module(n)])["parameters"] for name, n in graph.nodes.items()}
        assert here == {"lm": full["lm"], "snac": 0}
        outputs = [o.name async for o in engine.submit("orpheus", {"text": "hi", "seed": 1, "max_tokens": 120})]
        assert "audio" in outputs  # the local LM (loaded) feeds the codec worker
    finally:
        await engine.close()
