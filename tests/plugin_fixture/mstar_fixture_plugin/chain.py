"""A three-stage streaming chain (Thinker -> Talker -> Code2Wav in miniature) for runtime v2 tests.

`gen` is an AR producer: per request and step it yields one item carrying an int token and a
hidden-state row (a tensor). A consumer loop on `talker` (an AR node with per-request state) takes
chunks of those items as the stream releases them and writes one codec frame (a tensor) per step,
which stream on to `window`, a windowed decoder with left context. Every value is a function of
the token, so a test can account for every item at the end.
"""

import time

import torch

from mstar_core.graph import DynamicLoop, Graph, GraphNode, NodeCall, StreamingGraphEdge, Walk
from mstar_core.model import LoadedModel, ModelSpec
from mstar_core.runtime.engine import Engine
from mstar_core.streaming import FixedChunkPolicy, LeftContextChunkPolicy

#: (node, request id, call count) in the order steps ran, per process (tests read it to prove overlap)
EVENTS: list[tuple[str, str, int]] = []


class ChainEngine(Engine):
    """Runs the node's `module(inputs, step)` per invocation, `step` counting this request's calls (its state)."""

    kind = "fixture_chain"

    def __init__(self, node, module, context):
        super().__init__(node, module, context)
        self.queue = []
        self.steps = {}
        self.delay = float(context.settings.get("step_delay", 0.0))

    def add(self, invocation):
        self.queue.append(invocation)

    def has_work(self):
        return bool(self.queue)

    def step(self):
        batch, self.queue = self.queue[: self.max_batch_size], self.queue[self.max_batch_size :]
        if self.delay:
            time.sleep(self.delay)
        out = []
        for inv in batch:
            n = self.steps.get(inv.request_id, 0)
            self.steps[inv.request_id] = n + 1
            EVENTS.append((self.node.name, inv.request_id, n))
            try:
                out.append((inv, self.module(inv.inputs, n)))
            except Exception as exc:
                out.append((inv, exc))
        return out

    def release(self, request_id):
        self.steps.pop(request_id, None)
        self.queue = [i for i in self.queue if i.request_id != request_id]

    def active_requests(self):
        return set(self.steps) | {i.request_id for i in self.queue}


def token_of(seed: int, i: int) -> int:
    return seed * 1000 + i


def gen_step(inputs, n):
    token = token_of(inputs["seed"], n)
    item = {"token": token, "hidden": torch.tensor([float(token), 10.0 * token])}
    return {"item": item, "done": n + 1 >= inputs["length"]}


def talker_step(inputs, n):
    items = inputs["text"].new_items
    for it in items:  # the token and its hidden row travelled together
        assert float(it["hidden"][1]) == 10.0 * it["token"], it
    frame = torch.tensor([2.0 * it["token"] for it in items])  # empty once the stream has ended
    return {"frame": frame}


def window_step(inputs, n):
    chunk = inputs["chunk"]
    return {"wav": torch.cat(list(chunk.new_items)) if chunk.new_items else torch.zeros(0),
            "context": int(sum(f.numel() for f in chunk.items[: chunk.num_context]))}


def chain_graph(text_chunk: int = 2, wav_chunk: int = 3, wav_left: int = 2, name: str = "fixture-chain") -> Graph:
    nodes = [
        GraphNode("gen", inputs=("seed", "length"), outputs=("item", "done"), engine="fixture_chain",
                  module=lambda: gen_step),
        GraphNode("talker", inputs=("text",), outputs=("frame",), engine="fixture_chain", module=lambda: talker_step),
        GraphNode("window", inputs=("chunk",), outputs=("wav", "context"), engine="fixture_chain",
                  module=lambda: window_step),
    ]
    walk = Walk(
        name="speak",
        body=DynamicLoop(body="gen", until=lambda env: env["done"], max_iters="length"),
        inputs=("seed", "length"),
        outputs=("wav",),
        emit=("wav", "frame"),
        streams=(
            StreamingGraphEdge(
                "gen.item", policy=FixedChunkPolicy(text_chunk), into="text_in",
                consumer=DynamicLoop(body=NodeCall("talker", inputs={"text": "text_in"}),
                                     until=lambda env: True, max_iters=10**6),
            ),
            StreamingGraphEdge("talker.frame", "window.chunk", LeftContextChunkPolicy(wav_chunk, wav_left),
                               keep=lambda frame: frame.numel() > 0),
        ),
    )
    return Graph.build(name, nodes, [walk])


def load(options):
    return LoadedModel(name="fixture-chain", graph=chain_graph(), random_weights=True)


SPEC = ModelSpec(name="fixture-chain", load=load, description="producer -> consumer loop -> windowed decoder (tests)")
