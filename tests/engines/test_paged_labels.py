"""Cache labels mid-request: reset, snapshot, drop, and labels chosen per call (as the conductor resolves them)."""

from __future__ import annotations

import torch

from tests.engines.paged_tiny import TinyNode, dense, engine_for, run


def test_reset_equals_a_fresh_request_and_frees_the_old_pages():
    module = TinyNode()
    engine = engine_for(module)
    frames = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]
    fresh = engine_for(module)
    for i, frame in enumerate(frames):  # a scratch cache per frame (Qwen3-Omni's code predictor)
        got = run(engine, "r", {"input_ids": frame}, cache_label="scratch", reset=True)
        want = run(fresh, f"alone{i}", {"input_ids": frame})
        torch.testing.assert_close(got["hidden"], want["hidden"], atol=1e-6, rtol=0)
        torch.testing.assert_close(got["hidden"], dense(module, frame), atol=1e-5, rtol=0)
        assert engine.pool.num_used == -(-len(frame) // engine.pool.page_size)
    # and a decode row after a reset continues the new frame only
    got = run(engine, "r", {"input_ids": [15]}, cache_label="scratch")
    torch.testing.assert_close(got["hidden"], dense(module, frames[-1] + [15])[-1:], atol=1e-5, rtol=0)


def test_labels_chosen_per_call_equal_separate_requests():
    module = TinyNode()
    engine = engine_for(module)
    context = [1, 2, 3, 4, 5, 6, 7]
    run(engine, "r", {"input_ids": context}, cache_label="ctx")
    steps = {0: [20, 21], 1: [22], 2: [23, 24, 25]}
    for i, tokens in steps.items():  # cache_label=FromEnv("loop_index", "sample{}") resolves to these
        got = run(engine, "r", {"input_ids": tokens}, cache_label=f"sample{i}", fork_from="ctx")
        torch.testing.assert_close(got["hidden"], dense(module, context + tokens)[len(context):], atol=1e-5, rtol=0)
    for i, tokens in steps.items():  # each sample label goes on independently
        got = run(engine, "r", {"input_ids": [30]}, cache_label=f"sample{i}")
        torch.testing.assert_close(got["hidden"], dense(module, context + tokens + [30])[-1:], atol=1e-5, rtol=0)
    assert run(engine, "r", {"input_ids": [1]}, cache_label="ctx", drop=["sample0", "sample1", "sample2"])
    assert set(engine.seqs) == {("r", "ctx")}


def test_snapshot_before_and_after_hold_the_context_of_that_moment():
    module = TinyNode()
    engine = engine_for(module)
    a, b, c = [1, 2, 3, 4, 5], [6, 7, 8], [9, 10]
    run(engine, "r", {"input_ids": a}, snapshot_after="after_a")
    run(engine, "r", {"input_ids": b}, snapshot_before="before_b")
    run(engine, "r", {"input_ids": c})
    for label, ctx in (("after_a", a), ("before_b", a), ("main", a + b + c)):
        got = run(engine, "r", {"input_ids": [40]}, cache_label=label, write_cache=False)
        torch.testing.assert_close(got["hidden"], dense(module, ctx + [40])[-1:], atol=1e-5, rtol=0)
    run(engine, "r", {"input_ids": [41]}, write_cache=False, drop=["after_a", "before_b"])  # (a reader may drop too)
    assert set(engine.seqs) == {("r", "main")}


def test_drop_after_a_write_returns_unshared_pages():
    module = TinyNode()
    engine = engine_for(module)
    run(engine, "r", {"input_ids": list(range(1, 10))})
    run(engine, "r", {"input_ids": list(range(1, 13))}, cache_label="other")
    used = engine.pool.num_used
    run(engine, "r", {"input_ids": [5]}, drop="other")
    assert ("r", "other") not in engine.seqs and engine.pool.num_used < used
