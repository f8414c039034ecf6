"""Greedy decoding through the paged-KV engine matches transformers token for token (64 steps)."""

from __future__ import annotations

import pytest

from tests.engines.conftest import hf_greedy, make_pair
from tests.engines.driver import generate, make_engine

STEPS = 64


def _prompts(lengths, vocab=256):
    return {f"r{i}": [(7 * i + 13 * j + 1) % vocab for j in range(n)] for i, n in enumerate(lengths)}


def _check(hf, got, prompts):
    for rid, prompt in prompts.items():
        assert got[rid] == hf_greedy(hf, prompt, STEPS), rid


def test_batch_mixed_lengths_chunked_prefill_across_pages(llama_pair):
    hf, ours = llama_pair
    prompts = _prompts([1, 7, 30, 13, 45])
    # page_size 4 crosses page boundaries constantly; a 16-token budget splits the long prompts
    engine = make_engine(ours, num_pages=256, page_size=4, max_num_batched_tokens=16)
    got = generate(engine, prompts, STEPS)
    assert engine.num_steps > STEPS + 45 // 16  # the long prompts really were chunked
    _check(hf, got, prompts)
    assert engine.pool.num_used == 0


def test_prompt_chunked_beside_decode_rows_matches_transformers(llama_pair):
    """A prompt arriving while another request decodes is prefilled `prefill_step_tokens` at a time beside its decode
    row (the scheduler's cap), and both still decode exactly what transformers does."""
    from mstar_core.runtime.engine import Invocation

    hf, ours = llama_pair
    prompts = _prompts([5, 45])
    engine = make_engine(ours, num_pages=128, page_size=4, max_num_batched_tokens=64, prefill_step_tokens=8)
    plans = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda *a: plans.append(schedule(*a)) or plans[-1]
    out = {rid: [] for rid in prompts}
    engine.add(Invocation("r0", "lm", {"input_ids": prompts["r0"]}, {}))
    while engine.has_work():
        for inv, res in engine.step():
            assert not isinstance(res, BaseException), res
            out[inv.request_id].append(res["next_token"])
            if len(out[inv.request_id]) < STEPS:
                engine.add(Invocation(inv.request_id, "lm", {"input_ids": res["next_token"]}, {}))
            else:
                engine.release(inv.request_id)
            if inv.request_id == "r0" and len(out["r0"]) == 3:  # r1 arrives while r0 decodes
                engine.add(Invocation("r1", "lm", {"input_ids": prompts["r1"]}, {}))
    chunks = [[(s.request_id, n) for s, n in p.work] for p in plans if any(s.request_id == "r1" for s, _ in p.work)]
    assert chunks[:6] == [[("r0", 1), ("r1", 8)]] * 5 + [[("r0", 1), ("r1", 5)]]  # 45 = 5 x 8 + 5, r0 never waits
    _check(hf, out, prompts)
    assert engine.pool.num_used == 0
    assert make_engine(ours, num_pages=8).scheduler.prefill_step_tokens == 256  # a CPU node's default


def test_prefix_cache_hits_give_same_tokens(llama_pair):
    hf, ours = llama_pair
    shared = [(5 * j + 3) % 256 for j in range(40)]
    engine = make_engine(ours, num_pages=128, page_size=8)
    first = {"a": shared + [9, 8, 7]}
    _check(hf, generate(engine, first, STEPS), first)
    second = {"b": shared + [1, 2], "c": shared[:20]}
    got = generate(engine, second, STEPS)
    assert engine.pool.hits >= 40 // 8 + 20 // 8  # every full shared page was reused
    _check(hf, got, second)


def test_preemption_recomputes_exactly(llama_pair):
    hf, ours = llama_pair
    prompts = _prompts([20, 25, 30, 18])
    # 4 requests x ~90 tokens need ~96 pages of 4; 40 pages force preemptions
    engine = make_engine(ours, num_pages=40, page_size=4, max_num_batched_tokens=64)
    used = []
    got = generate(engine, prompts, STEPS, on_step=lambda e: used.append(e.pool.num_used))
    assert engine.num_preemptions > 0
    assert max(used) <= 40
    _check(hf, got, prompts)
    assert engine.pool.num_used == 0


@pytest.mark.slow
def test_second_config_gqa4_llama3_rope(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    hf, ours = make_pair(tmp_path, num_attention_heads=8, num_key_value_heads=2, rope_parameters=rope,
                         tie_word_embeddings=True)
    prompts = _prompts([3, 17, 33])
    engine = make_engine(ours, num_pages=128, page_size=16, max_num_batched_tokens=24)
    _check(hf, generate(engine, prompts, STEPS), prompts)
