"""Scheduler policy alone (no model): budget, chunking, caps, FIFO, priority, preemption order."""

from __future__ import annotations

import pytest
from mstar_kvcache.blocks import BlockManager
from mstar_kvcache.pool import PagePool
from mstar_kvcache.scheduler import Scheduler
from mstar_kvcache.sequence import Sequence


def _setup(num_pages=32, page_size=4, seqs=4, tokens=64):
    pool = PagePool(num_pages, page_size, num_layers=1, num_kv_heads=1, head_dim=2)
    return pool, Scheduler(BlockManager(pool), max_num_seqs=seqs, max_num_batched_tokens=tokens)


def _seq(name, n, order, priority=0.0):
    seq = Sequence(name, "main", tokens=list(range(1, n + 1)), order=order, priority=priority)
    seq.pending = object()
    return seq


def _run(plan):
    for seq, n in plan.work:  # what the engine does after a forward
        seq.num_computed += n


def test_budget_chunks_prefill_first_come_first_served():
    _, sched = _setup(tokens=10)
    a, b = _seq("a", 25, 0), _seq("b", 3, 1)
    plan = sched.schedule([a, b], lambda: [a, b])
    assert [(s.request_id, n) for s, n in plan.work] == [("a", 10)]  # FIFO: b waits behind a's chunk
    _run(plan)
    plan = sched.schedule([a, b], lambda: [a, b])
    assert [(s.request_id, n) for s, n in plan.work] == [("a", 10)]
    _run(plan)
    plan = sched.schedule([a, b], lambda: [a, b])
    assert [(s.request_id, n) for s, n in plan.work] == [("a", 5), ("b", 3)]


def test_max_num_seqs_and_priority():
    _, sched = _setup(seqs=2)
    seqs = [_seq("low", 3, 0), _seq("mid", 3, 1, priority=1.0), _seq("high", 3, 2, priority=5.0)]
    plan = sched.schedule(seqs, lambda: seqs)
    assert [s.request_id for s, _ in plan.work] == ["high", "mid"]


def test_out_of_pages_preempts_lowest_ranked_holder():
    pool, sched = _setup(num_pages=4, page_size=4)
    first, second = _seq("first", 8, 0), _seq("second", 8, 1)
    _run(sched.schedule([first, second], lambda: [first, second]))
    assert pool.num_available == 0
    first.tokens.append(1)  # first decodes a token: needs a third page, so 'second' (later arrival) is preempted
    plan = sched.schedule([first], lambda: [first, second])
    assert [s.request_id for s in plan.preempted] == ["second"] and second.num_computed == 0
    assert [(s.request_id, n) for s, n in plan.work] == [("first", 1)]


def test_background_sequences_go_after_live_ones_in_small_chunks():
    """Batch API lines (BACKGROUND_PRIORITY): a live arrival runs before an older background one, background
    prefill beside live work takes at most `background_step_tokens` a step, alone it takes the whole budget, and
    a background holder is the first preempted."""
    from mstar_core.runtime.engine import BACKGROUND_PRIORITY

    pool = PagePool(32, 4, num_layers=1, num_kv_heads=1, head_dim=2)
    sched = Scheduler(BlockManager(pool), max_num_seqs=4, max_num_batched_tokens=64, background_step_tokens=5)
    batch = _seq("batch", 20, 0, priority=BACKGROUND_PRIORITY)  # older than the live one
    live = _seq("live", 6, 1)
    plan = sched.schedule([batch, live], lambda: [batch, live])
    assert [(s.request_id, n) for s, n in plan.work] == [("live", 6), ("batch", 5)]
    _run(plan)
    plan = sched.schedule([batch], lambda: [batch, live])  # no live work this step: the whole budget
    assert [(s.request_id, n) for s, n in plan.work] == [("batch", 15)]
    _run(plan)
    small = Scheduler(BlockManager(pool), max_num_seqs=4, max_num_batched_tokens=64)
    assert small._victim([batch, live], set(), exclude=live) is batch


def test_background_rows_take_turns_beside_live_work():
    """Beside live work at most `background_step_rows` background sequences join a step (the oldest first; each
    more row is compute in the live rows' step); alone, every background sequence runs."""
    from mstar_core.runtime.engine import BACKGROUND_PRIORITY

    pool = PagePool(64, 4, num_layers=1, num_kv_heads=1, head_dim=2)
    sched = Scheduler(BlockManager(pool), max_num_seqs=8, max_num_batched_tokens=64, background_step_tokens=8,
                      background_step_rows=2)
    lines = [_seq(f"line{i}", 2, i, priority=BACKGROUND_PRIORITY) for i in range(4)]
    live = _seq("live", 3, 9)
    everyone = [*lines, live]
    plan = sched.schedule(everyone, lambda: everyone)
    assert [(s.request_id, n) for s, n in plan.work] == [("live", 3), ("line0", 2), ("line1", 2)]
    _run(plan)
    for seq in lines[:2]:
        seq.tokens.append(7)  # each sampled a token: one to decode now
    live.tokens.append(7)
    plan = sched.schedule(everyone, lambda: everyone)  # two decode rows already hold pages: still two
    assert [(s.request_id, n) for s, n in plan.work] == [("live", 1), ("line0", 1), ("line1", 1)]
    _run(plan)
    for seq in lines[:2]:
        seq.tokens.append(7)
    plan = sched.schedule(lines, lambda: everyone)  # no live work this step: every background line runs
    assert [(s.request_id, n) for s, n in plan.work] == [("line0", 1), ("line1", 1), ("line2", 2), ("line3", 2)]
    with pytest.raises(ValueError, match="background_step_rows"):
        Scheduler(BlockManager(pool), max_num_seqs=8, max_num_batched_tokens=64, background_step_rows=0)


def test_prefill_step_tokens_caps_prompt_chunks_beside_decode_rows():
    """Beside decode rows a step takes at most `prefill_step_tokens` prompt tokens (the decoding streams' step stays
    short and a burst of prompts finishes one after another); with no decode row a prompt takes the whole budget, and
    decode rows are never held back by the cap."""
    pool = PagePool(64, 4, num_layers=1, num_kv_heads=1, head_dim=2)
    sched = Scheduler(BlockManager(pool), max_num_seqs=8, max_num_batched_tokens=40, prefill_step_tokens=10)
    first = _seq("first", 30, 0)
    plan = sched.schedule([first], lambda: [first])
    assert [(s.request_id, n) for s, n in plan.work] == [("first", 30)]  # nothing decodes: the whole budget
    _run(plan)
    first.tokens.append(7)  # sampled its first token: now it decodes
    a, b = _seq("a", 7, 1), _seq("b", 25, 2)
    everyone = [first, a, b]
    plan = sched.schedule(everyone, lambda: everyone)
    assert [(s.request_id, n) for s, n in plan.work] == [("first", 1), ("a", 7), ("b", 3)]
    _run(plan)
    first.tokens.append(7)
    a.tokens.append(7)
    plan = sched.schedule(everyone, lambda: everyone)  # b's chunks go on, 10 prompt tokens a step
    assert [(s.request_id, n) for s, n in plan.work] == [("first", 1), ("a", 1), ("b", 10)]
    _run(plan)
    for seq in (first, a):  # the decode rows leave: b takes what the budget holds
        seq.pending = None
    plan = sched.schedule([b], lambda: everyone)
    assert [(s.request_id, n) for s, n in plan.work] == [("b", 12)]


def test_prefill_step_tokens_lets_a_block_that_cannot_be_chunked_run():
    """A non-causal block (not chunkable) larger than the cap still runs beside decode rows, within the budget."""
    pool = PagePool(64, 4, num_layers=1, num_kv_heads=1, head_dim=2)
    sched = Scheduler(BlockManager(pool), max_num_seqs=8, max_num_batched_tokens=40, prefill_step_tokens=4)
    first = _seq("first", 4, 0)
    _run(sched.schedule([first], lambda: [first]))
    first.tokens.append(7)
    block = _seq("block", 12, 1)
    block.chunkable = False
    plan = sched.schedule([first, block], lambda: [first, block])
    assert [(s.request_id, n) for s, n in plan.work] == [("first", 1), ("block", 12)]
    with pytest.raises(ValueError, match="prefill_step_tokens"):
        Scheduler(BlockManager(pool), max_num_seqs=8, max_num_batched_tokens=40, prefill_step_tokens=0)


def test_prefill_step_tokens_setting_defaults_by_device_and_names_a_bad_value():
    """Absent, the cap is 256 on a CPU node and the whole budget elsewhere; a given value holds anywhere; a bad one is
    an error naming the setting."""
    import torch
    from mstar_kvcache.config import CPU_PREFILL_STEP_TOKENS, KVCacheSettings

    from mstar_core.errors import ConfigError

    default = KVCacheSettings.from_mapping({})
    assert default.resolve_prefill_step_tokens(torch.device("cpu")) == CPU_PREFILL_STEP_TOKENS == 256
    assert default.resolve_prefill_step_tokens(torch.device("cuda")) is None
    given = KVCacheSettings.from_mapping({"prefill_step_tokens": 512})
    assert given.resolve_prefill_step_tokens(torch.device("cpu")) == 512
    assert given.resolve_prefill_step_tokens(torch.device("cuda")) == 512
    for bad in (0, -3, 1.5, True, "256"):
        with pytest.raises(ConfigError, match="'prefill_step_tokens'"):
            KVCacheSettings.from_mapping({"prefill_step_tokens": bad})
