"""The stateless engine: stacking, padding, forward_batch, and failure isolation."""

from __future__ import annotations

import pytest
import torch
from mstar_stateless import StatelessEngine

from mstar_core.graph import GraphNode
from mstar_core.runtime.engine import EngineContext, Invocation


def _engine(module, **options):
    node = GraphNode("codec", inputs=("x",), outputs=("y",), engine="stateless", options=options)
    return StatelessEngine(node, module, EngineContext("t", torch.device("cpu"), {}))


class Upsample(torch.nn.Module):
    """Doubles the last axis (like a codec's hop), counting how often it runs."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if (x < 0).any():
            raise ValueError("negative input")
        return torch.repeat_interleave(x * 2, 2, dim=-1)


@pytest.mark.parametrize(("options", "shapes"), [
    ({}, [(3, 5)] * 4),  # same shapes stack as they are
    ({"pad_dim": -1, "pad_value": 0.0}, [(2, 3), (2, 7), (2, 5)]),  # padded along the declared dim, trimmed back
], ids=["same-shapes-stack", "padded-and-trimmed"])
def test_a_batch_runs_in_one_call_and_each_answer_is_its_own(options, shapes):
    mod = Upsample()
    engine = _engine(mod, **options)
    xs = [torch.rand(*shape) for shape in shapes]
    for i, x in enumerate(xs):
        engine.add(Invocation(f"r{i}", "codec", {"x": x}, {}))
    results = engine.step()
    assert mod.calls == 1
    for (_, out), x in zip(results, xs, strict=True):
        torch.testing.assert_close(out["y"], torch.repeat_interleave(x * 2, 2, dim=-1))


def test_one_bad_call_fails_alone():
    mod = Upsample()
    engine = _engine(mod)
    engine.add(Invocation("good", "codec", {"x": torch.ones(4)}, {}))
    engine.add(Invocation("bad", "codec", {"x": -torch.ones(4)}, {}))
    engine.add(Invocation("good2", "codec", {"x": torch.ones(4)}, {}))
    results = {inv.request_id: out for inv, out in engine.step()}
    assert isinstance(results["bad"], ValueError)
    assert torch.equal(results["good"]["y"], torch.full((8,), 2.0)) and not isinstance(results["good2"], Exception)


def test_forward_batch_and_release():
    class Batched:
        def __init__(self):
            self.sizes = []

        def forward_batch(self, calls):
            self.sizes.append(len(calls))
            return [{"y": c["x"] + 1} for c in calls]

    mod = Batched()
    engine = _engine(mod)
    for i in range(3):
        engine.add(Invocation(f"r{i}", "codec", {"x": i}, {}))
    engine.release("r1")
    assert engine.active_requests() == {"r0", "r2"}
    assert [out["y"] for _, out in engine.step()] == [1, 3] and mod.sizes == [2]
