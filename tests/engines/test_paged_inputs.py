"""Inputs per call: embeddings at placeholders, explicit and multi-axis positions, routing ids, module tensors."""

from __future__ import annotations

import torch

from mstar_core.runtime.engine import Invocation
from tests.engines.paged_tiny import HIDDEN, TinyNode, causal_then_block, dense, drain, engine_for, run


def test_embeddings_at_placeholders_and_embeddings_only():
    module = TinyNode()
    engine = engine_for(module)
    ids = [1, 2, 0, 0, 0, 3]
    rows = torch.randn(3, HIDDEN)
    out = run(engine, "r", {"input_ids": ids, "input_embeds": rows, "embeds_at": torch.tensor([2, 3, 4])})
    spliced = module.embed(torch.tensor(ids)).detach().clone()
    spliced[2:5] = rows
    torch.testing.assert_close(out["hidden"], dense(module, input_embeds=spliced), atol=1e-5, rtol=0)
    frames = torch.randn(4, HIDDEN)  # a node fed embeddings only (V-JEPA frame tokens): no token embedding at all
    module.embed = None
    out = run(engine, "v", {"input_embeds": frames})
    torch.testing.assert_close(out["hidden"], dense(TinyNode(), input_embeds=frames), atol=1e-5, rtol=0)


def test_a_whole_image_block_at_one_position_then_text_continues():
    module = TinyNode()
    engine = engine_for(module)
    text, image, more = [1, 2, 3], [9, 9, 9, 9], [4, 5]
    run(engine, "r", {"input_ids": text})
    run(engine, "r", {"input_ids": image, "positions": torch.full((4,), 3)}, bidirectional=True)
    out = run(engine, "r", {"input_ids": more})  # implicit positions continue after the largest: 4, 5
    positions = torch.tensor([0, 1, 2, 3, 3, 3, 3, 4, 5])
    mask = causal_then_block(3, 4)
    mask = torch.cat((torch.cat((mask, torch.zeros(7, 2, dtype=torch.bool)), 1), torch.ones(2, 9).bool().tril(7)))
    ref = dense(module, text + image + more, positions=positions, mask=mask)
    torch.testing.assert_close(out["hidden"], ref[-2:], atol=1e-5, rtol=0)


def test_multi_axis_positions():
    module = TinyNode(axes=3)
    engine = engine_for(module)
    pos = torch.tensor([[0, 1, 2, 2, 2, 5], [0, 1, 2, 3, 4, 5], [0, 1, 2, 2, 3, 5]])
    ids = [1, 2, 3, 4, 5, 6]
    run(engine, "r", {"input_ids": ids, "positions": pos})
    out = run(engine, "r", {"input_ids": [7]})  # next: 6 on every axis
    full = torch.cat((pos, torch.full((3, 1), 6)), 1)
    torch.testing.assert_close(out["hidden"], dense(module, ids + [7], positions=full)[-1:], atol=1e-5, rtol=0)


def test_routing_and_module_tensors_batch_across_requests_as_alone():
    module = TinyNode()
    calls = {
        "a": {"input_ids": [1, 2, 3, 4, 5], "routing": torch.tensor([0, 0, 1, 1, 1]), "noise": torch.randn(5, 4),
              "timestep": torch.tensor([0.25])},
        "b": {"input_ids": [6, 7, 8], "routing": torch.tensor([1, 0, 1]), "timestep": torch.tensor([0.75])},
        "c": {"input_ids": [9, 10]},
    }
    together = engine_for(module)
    for rid, inputs in calls.items():
        together.add(Invocation(rid, "dit", inputs, {}))
    before = module.calls
    got = drain(together)
    assert module.calls == before + 1
    for rid, inputs in calls.items():
        alone = run(engine_for(module), rid, inputs)
        torch.testing.assert_close(got[rid]["velocity"], alone["velocity"], atol=1e-5, rtol=0)
    kwargs = {k: v for k, v in calls["a"].items() if k in ("routing", "noise", "timestep")}
    ref = dense(module, calls["a"]["input_ids"], sequence_index=torch.zeros(5, dtype=torch.long), **kwargs)
    torch.testing.assert_close(got["a"]["hidden"], ref, atol=1e-5, rtol=0)


def test_per_token_rows_gather_across_prefill_chunks():
    module = TinyNode()
    engine = engine_for(module, max_num_batched_tokens=4)
    ids = list(range(1, 12))
    out = run(engine, "r", {"input_ids": ids})
    assert engine.num_steps == 3
    torch.testing.assert_close(out["hidden"], dense(module, ids), atol=1e-5, rtol=0)
