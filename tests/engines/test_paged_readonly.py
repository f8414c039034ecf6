"""Read-only attention over frozen labels: exact against dense attention, no page taken, one forward for CFG."""

from __future__ import annotations

import torch

from mstar_core.runtime.engine import Invocation
from tests.engines.paged_tiny import TinyNode, causal_then_block, dense, drain, engine_for, run

PREFIX = list(range(1, 19))  # 18 tokens: four full pages of 4 and a partial one


def test_read_only_equals_dense_and_takes_no_page():
    module = TinyNode()
    engine = engine_for(module)
    run(engine, "r", {"input_ids": PREFIX})  # writes the prefix
    used, available, kv = engine.pool.num_used, engine.pool.num_available, engine.pool.kv.clone()
    new = [40, 41, 42, 43, 44]
    out = run(engine, "r", {"input_ids": new}, write_cache=False, bidirectional=True)
    assert engine.pool.num_used == used and engine.pool.num_available == available
    assert torch.equal(engine.pool.kv, kv)  # nothing written anywhere, not even into a spare slot
    assert len(engine.seqs["r", "main"].tokens) == len(PREFIX)
    ref = dense(module, PREFIX + new, mask=causal_then_block(len(PREFIX), len(new)))
    torch.testing.assert_close(out["hidden"], ref[len(PREFIX):], atol=1e-5, rtol=0)
    torch.testing.assert_close(out["velocity"], module.vel(ref[len(PREFIX):]).detach(), atol=1e-5, rtol=0)
    # causal own rows too, and again (the label is unchanged by the first read)
    out = run(engine, "r", {"input_ids": new}, write_cache=False)
    ref = dense(module, PREFIX + new)
    torch.testing.assert_close(out["hidden"], ref[len(PREFIX):], atol=1e-5, rtol=0)
    assert engine.pool.num_used == used


def test_read_only_over_two_labels_in_order():
    module = TinyNode()
    engine = engine_for(module)
    a, b, new = [1, 2, 3, 4, 5], [6, 7, 8], [9, 10]
    run(engine, "r", {"input_ids": a}, cache_label="a")
    run(engine, "r", {"input_ids": a + b}, cache_label="ab")  # b's keys as they are after a
    # label 'a' then the tail of 'ab' is what a reader of ["a", "b-part"] sees; read ['ab'] alone as the check
    out = run(engine, "r", {"input_ids": new}, write_cache=False, read_labels=["ab"], output_rows="last")
    ref = dense(module, a + b + new)
    torch.testing.assert_close(out["hidden"], ref[-1:], atol=1e-5, rtol=0)


def test_three_cfg_branches_run_in_one_forward_and_equal_separate_runs():
    module = TinyNode()
    engine = engine_for(module)
    text, image, tail = [1, 2, 3, 4, 5, 6], [20, 21, 22], [7, 8]
    # BAGEL's labels: main holds everything, cfg_text lacks the last text, cfg_img lacks the image
    run(engine, "r", {"input_ids": text}, cache_label="main", snapshot_after="cfg_img")
    run(engine, "r", {"input_ids": image}, cache_label="main", bidirectional=True)
    run(engine, "r", {"input_ids": tail}, cache_label="main", snapshot_before="cfg_text")
    run(engine, "r", {"input_ids": tail}, cache_label="cfg_img")
    latents = torch.randn(4, 4)
    calls = module.calls
    steps = engine.num_steps
    used = engine.pool.num_used
    for label in ("main", "cfg_text", "cfg_img"):
        engine.add(Invocation("r", "dit", {"input_ids": [30] * 4, "noise": latents, "timestep": torch.tensor([0.5])},
                              {"cache_label": label, "write_cache": False, "bidirectional": True}))
    results = {inv.options["cache_label"]: res for inv, res in engine.step()}
    assert module.calls == calls + 1 and engine.num_steps == steps + 1  # one forward for the three branches
    assert set(results) == {"main", "cfg_text", "cfg_img"}
    assert engine.pool.num_used == used and not engine.has_work()
    contexts = {"main": (text, image, tail), "cfg_text": (text, image), "cfg_img": (text, tail)}
    for label, parts in contexts.items():
        alone = engine_for(module)
        for i, part in enumerate(parts):
            run(alone, "x", {"input_ids": part}, bidirectional=(part is image))
            del i
        ref = run(alone, "x", {"input_ids": [30] * 4, "noise": latents, "timestep": torch.tensor([0.5])},
                  write_cache=False, bidirectional=True)
        torch.testing.assert_close(results[label]["velocity"], ref["velocity"], atol=1e-5, rtol=0)


def test_decode_prefill_and_read_only_rows_share_one_forward():
    module = TinyNode()
    engine = engine_for(module)
    run(engine, "a", {"input_ids": [1, 2, 3]})
    run(engine, "b", {"input_ids": [4, 5, 6, 7, 8]})
    calls = module.calls
    engine.add(Invocation("a", "dit", {"input_ids": [9]}, {}))  # a decode row
    engine.add(Invocation("c", "dit", {"input_ids": [1, 2, 3, 4, 5, 6]}, {}))  # a prefill of a new request
    engine.add(Invocation("b", "dit", {"input_ids": [10, 11]}, {"write_cache": False}))  # a read-only call
    done = drain(engine)
    assert module.calls == calls + 1 and set(done) == {"a", "b", "c"}
    torch.testing.assert_close(done["b"]["hidden"], dense(module, [4, 5, 6, 7, 8, 10, 11])[-2:], atol=1e-5, rtol=0)
    torch.testing.assert_close(done["a"]["hidden"], dense(module, [1, 2, 3, 9])[-1:], atol=1e-5, rtol=0)


def test_a_released_label_stays_readable_by_an_attached_reader():
    module = TinyNode()
    engine = engine_for(module)
    run(engine, "r", {"input_ids": PREFIX})
    engine.add(Invocation("r", "dit", {"input_ids": [3, 4]}, {"write_cache": False}))
    engine.step()  # (attached and run in this step)
    engine.release("r")
    assert engine.pool.num_used == 0 and not engine.active_requests()
