"""The host KV tier (`kv_offload`): preempted sequences continue from host copies, evicted prefix pages come back."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from mstar_kvcache.config import KVCacheSettings
from mstar_kvcache.offload import StepCosts, host_tier
from mstar_kvcache.pool import PagePool

from mstar_core.errors import ConfigError
from mstar_core.runtime.engine import Invocation
from tests.engines.conftest import hf_greedy
from tests.engines.driver import generate, make_engine
from tests.engines.paged_tiny import HIDDEN, TinyNode, dense, drain, engine_for, run

STEPS = 24
# 4 requests x ~50 tokens need ~49 pages of 4: 20 pages force preemptions (4 of them)
TIGHT = dict(num_pages=20, page_size=4, max_num_batched_tokens=64)


def _prompts(lengths, vocab=256):
    return {f"r{i}": [(7 * i + 13 * j + 1) % vocab for j in range(n)] for i, n in enumerate(lengths)}


PROMPTS = _prompts([20, 25, 30, 18])


@pytest.fixture(scope="module")
def reference(llama_pair):
    hf, _ = llama_pair
    return {rid: hf_greedy(hf, prompt, STEPS) for rid, prompt in PROMPTS.items()}


@pytest.fixture(scope="module")
def recomputed(llama_pair):
    """The same run without the tier: every preempted sequence is recomputed."""
    engine = make_engine(llama_pair[1], **TIGHT)
    return generate(engine, PROMPTS, STEPS), engine


def test_offload_gives_the_recompute_tokens_with_fewer_forwarded(llama_pair, reference, recomputed):
    tokens, plain = recomputed
    engine = make_engine(llama_pair[1], **TIGHT, kv_offload={"host_pages": 64, "rule": "always"})
    used = []
    got = generate(engine, PROMPTS, STEPS, on_step=lambda e: used.append(e.stats()["kv_host_pages_used"]))
    assert got == tokens == reference
    stats = engine.stats()
    assert plain.num_preemptions > 0 and engine.num_preemptions > 0
    assert stats["kv_offloaded_sequences"] > 0 and stats["kv_pages_offloaded"] > 0
    assert stats["kv_pages_restored"] + stats["kv_pages_restored_in_place"] == stats["kv_pages_offloaded"]
    assert stats["kv_offload_recomputes"] == 0
    assert max(used) > 0  # the host really held pages between steps
    assert engine.tokens_forwarded < plain.tokens_forwarded  # restored, not recomputed
    assert stats["kv_host_pages_used"] == 0 and engine.pool.num_used == 0


def test_a_full_host_falls_back_to_recompute(llama_pair, reference):
    engine = make_engine(llama_pair[1], **TIGHT, kv_offload={"host_pages": 3, "rule": "always"})
    got = generate(engine, PROMPTS, STEPS)
    assert got == reference  # never fails a request: those that do not fit are recomputed
    stats = engine.stats()
    assert stats["kv_offload_host_full"] > 0 and stats["kv_offload_recomputes"] >= stats["kv_offload_host_full"]
    assert stats["kv_host_pages_used"] == 0


def test_rule_never_and_min_tokens_recompute(llama_pair, reference, recomputed):
    for offload in ({"host_pages": 64, "rule": "never"}, {"host_pages": 64, "min_tokens": 10_000}):
        engine = make_engine(llama_pair[1], **TIGHT, kv_offload=offload)
        assert generate(engine, PROMPTS, STEPS) == reference
        stats = engine.stats()
        assert stats["kv_offloaded_sequences"] == 0 and stats["kv_offload_recomputes"] == engine.num_preemptions > 0
        assert engine.tokens_forwarded == recomputed[1].tokens_forwarded


def test_rule_auto_gives_the_same_tokens(llama_pair, reference):
    engine = make_engine(llama_pair[1], **TIGHT, kv_offload={"host_pages": 64})
    assert generate(engine, PROMPTS, STEPS) == reference
    stats = engine.stats()
    assert stats["kv_offloaded_sequences"] + stats["kv_offload_recomputes"] == engine.num_preemptions
    assert stats["kv_recompute_token_seconds"] > 0 and stats["kv_offload_page_seconds"] > 0


def test_cancel_frees_host_pages(llama_pair):
    engine = make_engine(llama_pair[1], **TIGHT, kv_offload={"host_pages": 64, "rule": "always"})
    for rid, prompt in PROMPTS.items():
        engine.add(Invocation(rid, "lm", {"input_ids": list(prompt)}, {}))
    offloaded = []
    while engine.has_work() and not offloaded:
        for inv, res in engine.step():
            engine.add(Invocation(inv.request_id, "lm", {"input_ids": res["next_token"]}, {}))
        offloaded = [s for s in engine.seqs.values() if s.host is not None]
    assert offloaded, "no sequence was offloaded"
    held = engine.stats()["kv_host_pages_used"]
    seq = offloaded[0]
    mine = len(seq.host.pages)
    assert held >= mine > 0
    engine.release(seq.request_id)
    assert engine.stats()["kv_host_pages_used"] == held - mine
    assert seq.host is None
    for rid in PROMPTS:
        engine.release(rid)
    assert engine.stats()["kv_host_pages_used"] == 0 and engine.pool.num_used == 0 and not engine.active_requests()


def test_evicted_prefix_pages_spill_and_come_back(llama_pair):
    hf, ours = llama_pair
    a = [(5 * j + 3) % 256 for j in range(40)]
    b = [(11 * j + 2) % 256 for j in range(40)]
    forwarded = {}
    for spill in (False, True):
        offload = {"host_pages": 32, "spill_prefixes": True} if spill else {"host_pages": 32, "rule": "never"}
        engine = make_engine(ours, num_pages=16, page_size=4, kv_offload=offload)
        generate(engine, {"a": a}, 4)  # a's 11 pages stay cached once it ends
        generate(engine, {"b": b}, 4)  # b needs 11 of 16 pages: most of a's cached pages are evicted
        before = engine.tokens_forwarded
        got = generate(engine, {"c": a}, 4)
        assert got["c"] == hf_greedy(hf, a, 4)
        forwarded[spill] = engine.tokens_forwarded - before
        stats = engine.stats()
        if spill:
            assert stats["kv_prefix_pages_spilled"] > 0 and stats["kv_prefix_spill_hits"] > 0
        else:
            assert stats["kv_prefix_pages_spilled"] == 0 and stats["kv_prefix_spill_hits"] == 0
    assert forwarded[True] < forwarded[False]  # the spilled pages came back instead of being recomputed
    assert forwarded[True] <= 4 + 4  # every full page of a's prompt: the last token and the decode steps computed


def test_a_preempted_copy_is_not_spilled_again_and_serves_prefix_hits():
    module = TinyNode()
    engine = engine_for(module, page_size=4, num_pages=6,
                        kv_offload={"host_pages": 16, "rule": "always", "spill_prefixes": True})
    b = list(range(20, 36))
    run(engine, "a", {"input_ids": list(range(1, 9))})
    run(engine, "b", {"input_ids": b})  # the pool is full
    run(engine, "c", {"input_ids": list(range(40, 48))})  # b (idle) goes to the host; c evicts b's cached pages
    stats = engine.stats()
    assert stats["kv_host_pages_used"] == 4 and stats["kv_prefix_pages_spilled"] == 0  # (its copy has them)
    before = engine.tokens_forwarded
    got = run(engine, "d", {"input_ids": b[:8] + [60]}, output_rows="last")  # b's first two pages, from its host copy
    assert engine.stats()["kv_prefix_spill_hits"] == 2 and engine.tokens_forwarded - before == 1
    torch.testing.assert_close(got["hidden"], dense(module, b[:8] + [60])[-1:], atol=1e-5, rtol=0)
    assert engine.seqs["b", "main"].host is not None  # b's copy is still whole
    got = run(engine, "b", {"input_ids": [61]})
    torch.testing.assert_close(got["hidden"], dense(module, b + [61])[-1:], atol=1e-5, rtol=0)
    for rid in "abcd":
        engine.release(rid)
    assert engine.stats()["kv_host_pages_used"] == 0 and not engine.offload._held


def test_a_preempted_idle_label_returns_its_rows_after_a_restore():
    module = TinyNode()
    engine = engine_for(module, page_size=4, num_pages=4, kv_offload={"host_pages": 8, "rule": "always"})
    a, b = list(range(1, 9)), list(range(20, 28))
    run(engine, "a", {"input_ids": a})
    run(engine, "b", {"input_ids": b})  # the pool is full
    got_a = run(engine, "a", {"input_ids": [9, 10, 11]})  # takes b's pages: b (idle) goes to the host
    before = engine.tokens_forwarded
    got_b = run(engine, "b", {"input_ids": [30, 31, 32]})  # b comes back from the host, a goes there
    assert engine.num_preemptions == 2 and engine.stats()["kv_offloaded_sequences"] == 2
    assert engine.tokens_forwarded - before == 3  # b's own tokens only: its 8 were restored, not recomputed
    for got, ctx, new in ((got_a, a, [9, 10, 11]), (got_b, b, [30, 31, 32])):
        assert got["hidden"].shape == (3, HIDDEN)
        torch.testing.assert_close(got["hidden"], dense(module, ctx + new)[-3:], atol=1e-5, rtol=0)
    got = run(engine, "a", {"input_ids": [12]}, output_rows="last")
    torch.testing.assert_close(got["hidden"], dense(module, a + [9, 10, 11, 12])[-1:], atol=1e-5, rtol=0)


def test_a_call_preempted_mid_prefill_keeps_its_gathered_rows():
    module = TinyNode()
    engine = engine_for(module, page_size=4, num_pages=6, max_num_batched_tokens=8,
                        kv_offload={"host_pages": 16, "rule": "always"})
    a1, a2, a3, b = list(range(1, 9)), list(range(9, 17)), list(range(17, 25)), list(range(40, 54))
    run(engine, "a", {"input_ids": a1})
    engine.add(Invocation("b", "lm", {"input_ids": b}, {}))
    engine.add(Invocation("a", "lm", {"input_ids": a2}, {}))
    assert [inv.request_id for inv, _ in engine.step()] == ["a"]  # a's call takes the whole budget
    assert engine.step() == [] and engine.seqs["b", "main"].num_computed == 8  # b's first chunk
    engine.add(Invocation("a", "lm", {"input_ids": a3}, {}))  # a needs b's pages: b goes out mid-call
    got = {inv.request_id: res for inv, res in engine.step()}
    assert engine.seqs["b", "main"].host is not None and engine.seqs["b", "main"].collected
    got.update(drain(engine))  # b comes back (a, idle, goes out) and computes its last 6 tokens only
    assert engine.num_preemptions == 2 and engine.stats()["kv_pages_restored"] == 2
    assert engine.tokens_forwarded == len(a1 + a2 + a3) + len(b)
    torch.testing.assert_close(got["b"]["hidden"], dense(module, b), atol=1e-5, rtol=0)  # all 14 rows
    torch.testing.assert_close(got["a"]["hidden"], dense(module, a1 + a2 + a3)[16:], atol=1e-5, rtol=0)


def test_a_reader_of_an_offloaded_label_gets_it_restored():
    module = TinyNode()
    engine = engine_for(module, page_size=4, num_pages=6, kv_offload={"host_pages": 16, "rule": "always"})
    prefix, other, new = list(range(1, 19)), list(range(30, 48)), [40, 41, 42]
    run(engine, "r", {"input_ids": prefix})  # 5 of the 6 pages
    run(engine, "s", {"input_ids": other})  # r (idle) goes to the host
    assert engine.seqs["r", "main"].host is not None
    before = engine.tokens_forwarded
    out = run(engine, "r", {"input_ids": new}, write_cache=False)  # r comes back for its reader, s goes out
    assert engine.tokens_forwarded - before == 1 + len(new)  # r's last token rewritten, then the reader's rows
    torch.testing.assert_close(out["hidden"], dense(module, prefix + new)[len(prefix):], atol=1e-5, rtol=0)
    assert engine.seqs["r", "main"].host is None and engine.seqs["s", "main"].host is not None


def test_auto_weighs_the_copy_against_the_recompute():
    costs = StepCosts(page_seconds=1e-5)
    for tokens in (1, 8, 32, 64, 8, 1):  # a step costs 10 ms + 1 ms per token
        costs.observe_step(tokens, 0.01 + 0.001 * tokens)
    assert costs.token_seconds == pytest.approx(0.001, rel=1e-6)
    assert costs.offload_pays(pages=4, tokens=16)  # 80 us of copies against 16 ms of recompute
    costs.page_seconds = 0.01
    assert not costs.offload_pays(pages=4, tokens=16)  # 80 ms of copies: recompute


@pytest.mark.parametrize(("value", "named"), [
    ({"host_pages": 8, "spill": True}, "kv_offload.spill"),
    ({"min_tokens": 4}, "kv_offload.host_pages"),
    ({"host_pages": 0}, "kv_offload.host_pages"),
    ({"host_pages": True}, "kv_offload.host_pages"),
    ({"host_pages": 8, "min_tokens": -1}, "kv_offload.min_tokens"),
    ({"host_pages": 8, "rule": "sometimes"}, "kv_offload.rule"),
    ({"host_pages": 8, "spill_prefixes": "yes"}, "kv_offload.spill_prefixes"),
    (8, "kv_offload"),
])
def test_config_errors_name_the_key(value, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        KVCacheSettings.from_mapping({"kv_offload": value})


def test_split_and_sharing_nodes_refuse_offload():
    settings = KVCacheSettings.from_mapping({"kv_offload": {"host_pages": 4}}).kv_offload
    pool = PagePool(4, 4, 1, 1, 8)
    with pytest.raises(ConfigError, match=r"node 'lm'.*'kv_offload'.*tensor_parallel 2"):
        host_tier(settings, pool, "lm", SimpleNamespace(world_size=2), None)
    with pytest.raises(ConfigError, match=r"node 'expert'.*'kv_offload'.*'vlm'"):
        host_tier(settings, pool, "expert", None, "vlm")
    assert host_tier(None, pool, "lm", None, None) is None


def test_through_the_runtime_the_setting_applies_and_the_counters_reach_metrics(llama_pair, reference):
    import asyncio

    from mstar_core.api.server.metrics import Metrics
    from mstar_core.runtime import AsyncEngine
    from mstar_core.sampling import SamplingParams
    from tests.engines.test_through_async_engine import _loaded

    async def main():
        engine = AsyncEngine()
        settings = {**TIGHT, "kv_offload": {"host_pages": 64, "rule": "always"}}
        await engine.add_model(_loaded(llama_pair[1]), settings={"lm": settings})
        try:
            async def tokens(handle):
                return [o.value async for o in handle if o.name == "next_token"]

            handles = [engine.submit("tinyllm", {"input_ids": p, "sampling": SamplingParams(max_tokens=STEPS)})
                       for p in PROMPTS.values()]
            got = await asyncio.gather(*(tokens(h) for h in handles))
            return got, engine.node_engines("tinyllm")["lm"].stats(), Metrics(engine).render().decode()
        finally:
            await engine.close()

    got, stats, metrics = asyncio.run(main())
    assert got == list(reference.values())
    assert stats["kv_pages_restored"] > 0 and stats["kv_host_pages_used"] == 0
    assert 'stat="kv_pages_offloaded"' in metrics and 'stat="kv_prefix_spill_hits"' in metrics
