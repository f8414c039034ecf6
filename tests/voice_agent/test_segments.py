"""Streams in segments (`StreamingGraphEdge.segment_by`): a producer inside a loop ends one segment per iteration;
the policy releases the segment's tail then (not when the whole producer ends) and starts the next afresh."""

from __future__ import annotations

import asyncio
import random

import pytest

from mstar_core.errors import GraphValidationError
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
from mstar_core.runtime import AsyncEngine
from mstar_core.streaming import FixedChunkPolicy, LeftContextChunkPolicy, SlidingWindowChunkPolicy


@pytest.mark.parametrize("policy", [FixedChunkPolicy(3), LeftContextChunkPolicy(3, 2), SlidingWindowChunkPolicy(4, 2),
                                    SlidingWindowChunkPolicy(3, 3, tail="flush")])
@pytest.mark.parametrize("seed", range(5))
def test_a_segment_ends_like_a_stream_and_the_next_starts_afresh(policy, seed):
    rng = random.Random(seed)
    segments = [[f"{s}.{i}" for i in range(rng.randrange(0, 9))] for s in range(rng.randrange(1, 5))]
    stream = policy.open()
    for items in segments:
        chunks = [c for item in items for c in stream.push(item)] + stream.end_segment()
        assert not any(c.final for c in chunks)
        whole = policy.open()  # the same items as a stream of their own
        alone = [c for item in items for c in whole.push(item)] + whole.close()
        assert [c.items for c in chunks] == [c.items for c in alone]  # no context reaches back across the boundary
    assert stream.close() == []


class Count:
    def __call__(self, n, loop_index):
        return [f"{loop_index}.{i}" for i in range(n)]


class Emit:
    def __call__(self, frames, step):
        return frames[step]


class Decode:
    def __call__(self, chunk):
        return tuple(chunk.new_items)


def speaker() -> LoadedModel:
    """Per sentence (outer loop), emit a few frames (inner loop); a windowed decoder reads them in segments."""
    nodes = [GraphNode("plan", inputs=("n", "loop_index"), outputs=("frames",), engine="function", module=Count),
             GraphNode("frame", inputs=("frames", "step"), outputs=("item",), engine="function", module=Emit),
             GraphNode("decode", inputs=("chunk",), outputs=("audio",), engine="function", module=Decode)]
    inner = Loop(body=NodeCall("frame", inputs={"frames": "frames", "step": "step"}), iters="n", index_name="step")
    body = Loop(body=Sequential(NodeCall("plan"), inner), iters="sentences")
    walk = Walk(name="speak", body=body, inputs=("n", "sentences"), emit=("audio",),
                streams=[StreamingGraphEdge("frame.item", "decode.chunk", LeftContextChunkPolicy(4, 4),
                                            segment_by="loop_index")])
    return LoadedModel(name="speaker", graph=Graph.build("speaker", nodes, [walk]))


def test_each_iteration_flushes_its_segment_while_the_loop_goes_on():
    async def go():
        async with AsyncEngine() as engine:
            await engine.add_model(speaker())
            handle = engine.submit("speaker", {"n": 5, "sentences": 3})
            return [o.value async for o in handle if o.name == "audio"]

    audio = asyncio.run(go())
    # per sentence: a window of 4, then its tail of 1 at the sentence's end (not joined with the next sentence's)
    assert audio == [("0.0", "0.1", "0.2", "0.3"), ("0.4",), ("1.0", "1.1", "1.2", "1.3"), ("1.4",),
                     ("2.0", "2.1", "2.2", "2.3"), ("2.4",)]


def test_segment_by_must_name_a_loop_of_the_walk():
    nodes = [GraphNode("a", inputs=(), outputs=("x",), engine="function", module=lambda: (lambda: 1)),
             GraphNode("b", inputs=("c",), outputs=("y",), engine="function", module=lambda: (lambda c: 1))]
    walk = Walk(name="w", body=DynamicLoop(body=NodeCall("a"), until=lambda e: True, max_iters=2),
                streams=[StreamingGraphEdge("a.x", "b.c", FixedChunkPolicy(1), segment_by="sentence")])
    with pytest.raises(GraphValidationError, match=r"segment_by='sentence' names no loop of the walk.*loop_index"):
        Graph.build("g", nodes, [walk])
