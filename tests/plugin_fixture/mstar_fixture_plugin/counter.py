"""A stateful engine and a streaming model for runtime and multi-process tests.

`CounterEngine` keeps a per-request counter (like a KV cache keeps pages) until released, and
can be slowed down with the `step_delay` setting so tests can act mid-stream.
"""

import time

import torch

from mstar_core.errors import RequestError
from mstar_core.graph import DynamicLoop, Graph, GraphNode, StreamingGraphEdge, Walk
from mstar_core.model import LoadedModel, ModelSpec
from mstar_core.runtime.engine import Engine
from mstar_core.streaming import FixedChunkPolicy


class CounterEngine(Engine):
    kind = "fixture_counter"

    def __init__(self, node, module, context):
        super().__init__(node, module, context)
        self.queue = []
        self.counters = {}
        self.delay = float(context.settings.get("step_delay", 0.0))

    def add(self, invocation):
        self.queue.append(invocation)

    def has_work(self):
        return bool(self.queue)

    def step(self):
        batch, self.queue = self.queue, []
        if self.delay:
            time.sleep(self.delay)
        out = []
        for inv in batch:
            n = self.counters.get(inv.request_id, inv.inputs["start"])
            self.counters[inv.request_id] = n + 1
            vec = torch.full((3,), float(n))
            if inv.inputs["start"] == -1:  # a value no wire format carries (for the worker tests)
                vec = vec.to_sparse()
            if inv.inputs["start"] == -2:  # the client's mistake, found by the engine (its status must survive)
                out.append((inv, RequestError("start -2 is refused", status=422)))
                continue
            out.append((inv, {"token": n, "vec": vec}))
        return out

    def release(self, request_id):
        self.counters.pop(request_id, None)
        self.queue = [i for i in self.queue if i.request_id != request_id]

    def active_requests(self):
        return set(self.counters) | {i.request_id for i in self.queue}

    def stats(self):
        return {"active": float(len(self.counters))}


def chunk_sum(codes):
    return {"total": torch.stack([v for v in codes.new_items]).sum(0)}


def load(options):
    nodes = [
        GraphNode("gen", inputs="start", outputs=("token", "vec"), engine="fixture_counter"),
        GraphNode("sum", inputs="codes", outputs="total", engine="function", module=lambda: chunk_sum),
    ]
    walk = Walk(
        name="count",
        body=DynamicLoop(body="gen", until=lambda env: env["token"] >= env["stop"], max_iters=10_000),
        inputs=("start", "stop"),
        outputs=("token", "total"),
        emit=("token", "total"),
        streams=(StreamingGraphEdge("gen.vec", "sum.codes", FixedChunkPolicy(4)),),
    )
    return LoadedModel(name="fixture-stream", graph=Graph.build("fixture-stream", nodes, [walk]), random_weights=True)


SPEC = ModelSpec(name="fixture-stream", load=load, description="counts and streams sums (test fixture)")
