"""Stream priority reaches every call of the TTS frame loop, not only the function node that emits the codes."""

from __future__ import annotations

import pytest

from mstar_core.errors import GraphValidationError
from mstar_core.graph import Graph, GraphNode, NodeCall, Sequential, StreamingGraphEdge, Walk, stream_priority
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.runtime import AsyncEngine
from mstar_core.runtime.scheduler import NodeScheduler
from mstar_core.streaming import FixedChunkPolicy


async def test_talker_and_predictor_calls_carry_the_listeners_priority(monkeypatch, tiny_dir):
    seen: dict[str, list[float]] = {}
    original = NodeScheduler.submit

    def spy(self, invocation):
        seen.setdefault(invocation.node, []).append(invocation.priority)
        return original(self, invocation)

    monkeypatch.setattr(NodeScheduler, "submit", spy)
    async with AsyncEngine(discover()) as engine:
        await engine.load_model("qwen3-tts", LoadOptions(preset="tiny"))
        await engine.generate("qwen3-tts", {"input": "Hello there!", "voice": "ryan", "max_frames": 6})
    # before its first audio (6 frames: less than a 25-frame window) a stream counts as START_LEAD seconds ahead less
    # the time it has waited: a priority from -2 growing with the wait, never the 0 of a call outside its reach
    for node in ("talker", "code_predictor", "frame_seed", "frame_step"):
        ranks = seen[node]
        assert ranks and all(p != 0.0 and p >= -2.0 for p in ranks) and ranks == sorted(ranks), (node, ranks)
    assert all(p == 0.0 for p in seen["talker_prompt"])  # before the loop: not named in fed_by


def test_fed_by_must_name_a_node_the_walk_calls():
    nodes = [GraphNode(n, inputs="x", outputs="x", engine="function", module=lambda: None) for n in ("a", "b", "c")]
    edge = dict(policy=FixedChunkPolicy(1), priority=stream_priority())
    ok = Walk(name="w", body=Sequential(NodeCall("a"), NodeCall("b")), inputs="x", outputs="x",
              streams=(StreamingGraphEdge("b.x", "c.x", fed_by=("a",), **edge),))
    Graph.build("g", nodes, [ok])
    bad = Walk(name="w", body=Sequential(NodeCall("a"), NodeCall("b")), inputs="x", outputs="x",
               streams=(StreamingGraphEdge("b.x", "c.x", fed_by=("nowhere",), **edge),))
    with pytest.raises(GraphValidationError, match="fed_by names node 'nowhere'"):
        Graph.build("g", nodes, [bad])
