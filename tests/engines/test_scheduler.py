"""Scheduler policy alone (no model): budget, chunking, caps, FIFO, priority, preemption order."""

from __future__ import annotations

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
