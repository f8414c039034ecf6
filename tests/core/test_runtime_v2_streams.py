"""Streams v2: a producer streaming into a consumer loop streaming into a windowed decoder, all concurrent."""

import asyncio

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mstar_fixture_plugin.chain import EVENTS, chain_graph, token_of

from mstar_core.cluster.remote_values import from_wire, to_wire
from mstar_core.errors import GraphValidationError, RequestCancelled
from mstar_core.graph import (
    DynamicLoop,
    Graph,
    GraphNode,
    Loop,
    NodeCall,
    Sequential,
    StreamingGraphEdge,
    Walk,
)
from mstar_core.model import LoadedModel
from mstar_core.plugins import discover
from mstar_core.runtime import AsyncEngine
from mstar_core.streaming import Chunk, FixedChunkPolicy
from mstar_core.wire.values import TensorSink, decode_value, encode_value


async def chain_engine(settings=None, **graph_kw):
    engine = AsyncEngine(discover())
    await engine.add_model(LoadedModel("chain", chain_graph(**graph_kw)), settings=settings)
    return engine


async def speak(engine, seed, length):
    handle = engine.submit("chain", {"seed": seed, "length": length})
    wavs, frames = [], []
    async for out in handle:
        (wavs if out.name == "wav" else frames).append(out.value)
    return wavs, frames, await handle.result()


def expected_wav(seed, length):
    return torch.tensor([2.0 * token_of(seed, i) for i in range(length)])


def assert_idle(engine, model="chain"):
    for node, eng in engine.node_engines(model).items():
        assert eng.active_requests() == set(), node
    for sched in engine.node_schedulers(model).values():
        assert not sched._pending and not sched._inflight
    assert engine.running == 0 and not engine._handles


async def wait_idle(engine, model="chain", timeout=5.0):
    """`assert_idle` once the cancellation has reached every stage (an in-flight step finishes first)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            return assert_idle(engine, model)
        except AssertionError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.01)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(length=st.integers(1, 30), text_chunk=st.integers(1, 6), wav_chunk=st.integers(1, 5),
       wav_left=st.integers(0, 4))
def test_every_item_reaches_the_end_of_the_chain_once(length, text_chunk, wav_chunk, wav_left):
    async def main():
        engine = await chain_engine(text_chunk=text_chunk, wav_chunk=wav_chunk, wav_left=wav_left)
        try:
            results = await asyncio.gather(*(speak(engine, seed, length + seed) for seed in (1, 2, 3)))
            for seed, (wavs, frames, env) in zip((1, 2, 3), results, strict=True):
                want = expected_wav(seed, length + seed)
                # the decoder's outputs, in order, are every codec frame once: nothing lost, nothing repeated
                assert torch.equal(torch.cat(wavs), want)
                assert torch.equal(torch.cat(frames), want)
                assert [w.numel() for w in env["wav"]] == [w.numel() for w in wavs]
            assert_idle(engine)
        finally:
            await engine.close()

    asyncio.run(main())


async def test_the_stages_run_concurrently():
    EVENTS.clear()
    engine = await chain_engine(settings={"gen": {"step_delay": 0.002}}, text_chunk=1)
    wavs, _, _ = await speak(engine, 4, 20)
    assert torch.equal(torch.cat(wavs), expected_wav(4, 20))
    order = [e[0] for e in EVENTS]
    last_gen = max(i for i, node in enumerate(order) if node == "gen")
    assert order.index("talker") < last_gen  # the consumer loop started before the producer's last step
    assert order.index("window") < last_gen  # and so did the decoder after it
    await engine.close()


async def test_cancelling_mid_chain_frees_every_stage():
    EVENTS.clear()
    engine = await chain_engine(settings={"gen": {"step_delay": 0.002}}, text_chunk=1, wav_chunk=1, wav_left=1)
    handle = engine.submit("chain", {"seed": 5, "length": 10**5})
    seen = 0
    async for out in handle:
        if out.name == "wav":
            seen += 1
            if seen == 3:  # every stage has run and holds state for the request
                break
    assert {e[0] for e in EVENTS} == {"gen", "talker", "window"}
    handle.cancel()
    with pytest.raises(RequestCancelled):
        await handle.result()
    await wait_idle(engine)
    # the engine keeps serving
    wavs, _, _ = await speak(engine, 6, 5)
    assert torch.equal(torch.cat(wavs), expected_wav(6, 5))
    await engine.close()


async def test_a_consumer_loop_waits_while_starved_and_ends_only_once_drained():
    # the consumer's own exit condition holds from its first step; it still takes every chunk
    engine = await chain_engine(settings={"gen": {"step_delay": 0.003}}, text_chunk=3)
    wavs, _, env = await speak(engine, 7, 11)
    assert torch.equal(torch.cat(wavs), expected_wav(7, 11))
    assert "text_in" not in env  # the stream's name stays inside its consumer fragment
    await engine.close()


def test_chunks_of_tensor_items_cross_the_wire_as_tensor_frames():
    items = ({"token": 3, "hidden": torch.tensor([3.0, 30.0])}, torch.arange(4, dtype=torch.int16))
    chunk = Chunk(items, start=5, num_context=1, final=True)
    sink = TensorSink()
    encoded = encode_value(to_wire({"c": chunk}), sink, "inputs")
    assert len(sink.frames) == 2  # both tensors travel as raw frames, not inside the JSON
    back = from_wire(decode_value(encoded, [t.clone() for t in _frames(sink)], "inputs"))["c"]
    assert back.start == 5 and back.num_context == 1 and back.final
    assert back.items[0]["token"] == 3 and torch.equal(back.items[0]["hidden"], items[0]["hidden"])
    assert torch.equal(back.items[1], items[1]) and back.items[1].dtype == torch.int16


def _frames(sink):
    from mstar_core.wire.tensors import frame_to_tensor

    return [frame_to_tensor(h, f) for h, f in zip(sink.headers, sink.frames, strict=True)]


def test_consumer_fragments_are_validated():
    nodes = [GraphNode("a", inputs="x", outputs="y", engine="function", module=lambda: abs),
             GraphNode("b", inputs="c", outputs="z", engine="function", module=lambda: abs)]

    def build(edge):
        return Graph.build("g", nodes, [Walk(name="w", body=DynamicLoop(body="a", until=lambda e: True, max_iters=3),
                                             inputs="x", streams=(edge,))])

    loop = DynamicLoop(body=NodeCall("b", inputs={"c": "chunks"}), until=lambda e: True, max_iters=9)
    build(StreamingGraphEdge("a.y", policy=FixedChunkPolicy(1), into="chunks", consumer=loop))
    with pytest.raises(GraphValidationError, match="no call in the consumer fragment .* reads 'other'"):
        build(StreamingGraphEdge("a.y", policy=FixedChunkPolicy(1), into="other", consumer=loop))
    with pytest.raises(GraphValidationError, match="needs exactly one consumer"):
        build(StreamingGraphEdge("a.y", "b.c", FixedChunkPolicy(1), into="chunks", consumer=loop))
    with pytest.raises(GraphValidationError, match="no chunk policy"):
        build(StreamingGraphEdge("a.y", into="chunks", consumer=loop))


def test_a_chain_draws_its_consumer_fragment():
    from mstar_core.graph import to_dot, to_mermaid

    text = to_mermaid(chain_graph(), "speak")
    assert "stream consumer, takes 'text_in'" in text and "talker [fixture_chain]" in text
    assert 'c0 == "item ~ FixedChunkPolicy(2, flush)" ==> c1' in text  # the producer feeds the loop's call
    assert "window [fixture_chain] (stream)" in text and "subgraph cluster_g2" in to_dot(chain_graph(), "speak")


def test_consumer_fragment_loops_are_delegated_unless_they_take_stream_chunks():
    from mstar_core.cluster.remote_loop import delegate_loops
    from mstar_core.cluster.remote_node import RemoteNodeScheduler
    from mstar_core.runtime.conductor import Conductor

    nodes = [GraphNode("a", inputs="x", outputs="y", engine="function", module=lambda: abs),
             GraphNode("b", inputs="c", outputs="z", engine="function", module=lambda: abs),
             GraphNode("c", inputs="z", outputs="q", engine="function", module=lambda: abs)]
    # the outer consumer loop takes chunks (it stays where its stream is); the loop inside it only calls `c`
    consumer = DynamicLoop(body=Sequential(NodeCall("b", inputs={"c": "chunks"}), Loop(body="c", iters=2)),
                           until=lambda e: True, max_iters=9)
    walk = Walk(name="w", body=DynamicLoop(body="a", until=lambda e: True, max_iters=3), inputs="x",
                streams=(StreamingGraphEdge("a.y", policy=FixedChunkPolicy(1), into="chunks", consumer=consumer),))
    graph = Graph.build("g", nodes, [walk])

    class Cluster:
        def replica_group(self, replicas):
            return replicas

    remote = {n: RemoteNodeScheduler(Cluster(), "g", n, ["w0"]) for n in graph.nodes}
    conductor = Conductor(graph, remote)
    sites = conductor.sites["w"]
    assert [loop.path for loop in sites.loops] == [(0,), (1,), (1, 0, 1)]  # the body's loop, then the fragment's
    assert delegate_loops(conductor, Cluster(), "g") == 2
    assert sorted(conductor.remote_loops) == [("w", 0), ("w", 2)]
