"""An engine that returns its inputs, renamed to the node's outputs in order."""

from mstar_core.runtime.engine import Engine


class EchoEngine(Engine):
    kind = "fixture_echo"

    def __init__(self, node, module, context):
        super().__init__(node, module, context)
        self.queue = []

    def add(self, invocation):
        self.queue.append(invocation)

    def has_work(self):
        return bool(self.queue)

    def step(self):
        batch, self.queue = self.queue[: self.max_batch_size], self.queue[self.max_batch_size :]
        return [(inv, dict(zip(self.node.outputs, (inv.inputs[i] for i in self.node.inputs), strict=True))) for inv in batch]

    def release(self, request_id):
        self.queue = [inv for inv in self.queue if inv.request_id != request_id]

    def active_requests(self):
        return {inv.request_id for inv in self.queue}
