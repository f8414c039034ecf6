"""Small graphs, functions and engines shared by the core tests."""

from __future__ import annotations

import torch

from mstar_core.graph import GraphNode
from mstar_core.runtime.engine import Engine, EngineContext, Invocation


def fn_node(name, inputs, outputs, fn, **kw):
    """A node on the function engine wrapping a plain callable."""
    return GraphNode(name, inputs=inputs, outputs=outputs, engine="function", module=lambda: fn, **kw)


def identity(**kw):
    return dict(kw)


class Queued(Engine):
    """An engine holding what it is given until its next step takes all of it (`take`); subclasses answer."""

    def __init__(self, node, module, context):
        super().__init__(node, module, context)
        self.queue: list[Invocation] = []

    def add(self, invocation):
        self.queue.append(invocation)

    def has_work(self):
        return bool(self.queue)

    def take(self) -> list[Invocation]:
        batch, self.queue = self.queue, []
        return batch

    def release(self, request_id):
        self.queue = [inv for inv in self.queue if inv.request_id != request_id]

    def active_requests(self):
        return {inv.request_id for inv in self.queue}


class Recording(Queued):
    """Answers every invocation it holds in one step; records the requests each step served and the most it held."""

    kind = "rec"

    def __init__(self, max_batch_size: int, max_active: int | None = None):
        node = GraphNode("n", inputs="x", outputs="y", engine="rec")
        super().__init__(node, None, EngineContext("w", torch.device("cpu"), {"max_batch_size": max_batch_size}))
        self.max_active_requests = max_active
        self.order: list[str] = []
        self.released: list[str] = []
        self.most = 0

    def add(self, inv):
        super().add(inv)
        self.most = max(self.most, len(self.queue))

    def step(self):
        batch = self.take()
        self.order += [inv.request_id for inv in batch]
        return [(inv, {}) for inv in batch]

    def release(self, request_id):
        self.released.append(request_id)
