"""Pool invariants: bounded page use, fully free after end/error/cancel, copy-on-write forks, cache-only calls."""

from __future__ import annotations

import pytest
import torch

from mstar_core.errors import RequestError
from mstar_core.nn.attention import DenseAttention
from mstar_core.runtime.engine import Invocation
from tests.engines.driver import generate, make_engine


def _need(engine) -> int:
    size = engine.pool.page_size
    return sum(-(-len(s.tokens) // size) for s in engine.seqs.values())


def test_pages_bounded_by_live_tokens_and_free_after_end(llama_pair):
    _, ours = llama_pair
    engine = make_engine(ours, num_pages=200, page_size=4, max_num_batched_tokens=12)
    prompts = {f"r{i}": list(range(1, 3 + 5 * i)) for i in range(5)}

    def check(e):
        # distinct pages in use never exceed full pages of live tokens + one partial page per label
        assert e.pool.num_used <= _need(e)

    generate(engine, prompts, 20, on_step=check)
    assert engine.pool.num_used == 0 and not engine.active_requests()


def test_free_after_error_and_cancellation(llama_pair):
    _, ours = llama_pair
    engine = make_engine(ours, num_pages=64, page_size=4, max_num_batched_tokens=8)
    engine.add(Invocation("long", "lm", {"input_ids": list(range(1, 40))}, {}))
    engine.add(Invocation("bad", "lm", {"input_ids": [1, 999]}, {}))
    results = engine.step()  # 'long' is mid-prefill (8 of 39 tokens); 'bad' fails validation
    assert [(i.request_id, type(r)) for i, r in results] == [("bad", RequestError)]
    assert "out" in str(results[0][1]) and engine.pool.num_used > 0
    engine.release("long")  # cancellation mid-prefill
    assert engine.pool.num_used == 0 and not engine.active_requests()

    class Boom(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config
            self.embed, self.compute_logits = inner.embed, inner.compute_logits  # (the contract, checked at load)

        def forward(self, *args, **kwargs):
            raise RuntimeError("device fell over")

    broken = make_engine(Boom(ours), num_pages=64, page_size=4)
    broken.add(Invocation("x", "lm", {"input_ids": [1, 2, 3, 4, 5]}, {}))
    (inv, err), = broken.step()
    assert isinstance(err, RuntimeError) and broken.pool.num_used == 0
    broken.release("x")
    assert not broken.active_requests()


def test_too_long_for_pool_is_a_clear_error(llama_pair):
    _, ours = llama_pair
    engine = make_engine(ours, num_pages=4, page_size=4)
    engine.add(Invocation("big", "lm", {"input_ids": list(range(1, 30))}, {}))
    (_, err), = engine.step()
    assert isinstance(err, RequestError) and "num_pages" in str(err)
    engine.release("big")
    assert engine.pool.num_used == 0


def test_fork_1000_token_prefix_copies_nothing_until_a_branch_writes(llama_pair):
    _, ours = llama_pair
    engine = make_engine(ours, num_pages=200, page_size=16, max_num_batched_tokens=1024)
    prompt = [(3 * j + 1) % 256 for j in range(1000)]
    engine.add(Invocation("r", "lm", {"input_ids": prompt}, {}))
    (_, out), = engine.step()
    used = engine.pool.num_used
    assert used == 63  # ceil(1000 / 16)
    engine.add(Invocation("r", "lm", {"input_ids": out["next_token"]}, {"cache_label": "cfg", "fork_from": "main"}))
    assert engine.pool.copies == 0 and engine.pool.num_used == used  # fork shares all 63 pages
    (_, branch), = engine.step()
    assert engine.pool.copies == 1  # only the shared partial last page was copied when 'cfg' wrote
    engine.add(Invocation("r", "lm", {"input_ids": out["next_token"]}, {}))
    (_, main), = engine.step()
    assert main["next_token"] == branch["next_token"]
    assert torch.equal(main["logits"], branch["logits"])
    assert engine.pool.copies == 1 and engine.pool.num_used == used + 1
    engine.release("r")
    assert engine.pool.num_used == 0


def test_write_cache_false_attends_without_appending(llama_pair):
    _, ours = llama_pair
    engine = make_engine(ours, num_pages=64, page_size=4)
    engine.add(Invocation("r", "lm", {"input_ids": list(range(1, 11))}, {}))
    engine.step()
    before = (list(engine.seqs["r", "main"].tokens), engine.pool.num_used)
    engine.add(Invocation("r", "lm", {"input_ids": [5, 6, 7]}, {"write_cache": False}))
    (_, peek), = engine.step()
    assert (engine.seqs["r", "main"].tokens, engine.pool.num_used) == before
    engine.add(Invocation("r", "lm", {"input_ids": [5, 6, 7]}, {}))
    (_, real), = engine.step()
    torch.testing.assert_close(peek["logits"], real["logits"])


def _dense_logits(model, ids, mask, embeds=None):
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), DenseAttention(mask=mask), input_embeds=embeds)
        return model.compute_logits(hidden[-1:])[0]


@pytest.mark.parametrize("kind", ["bidirectional", "frame"])
def test_block_masks_match_dense_reference(llama_pair, kind):
    _, ours = llama_pair
    ids = list(range(3, 20))  # 5 causal tokens, then a 12-token block
    pos = torch.arange(len(ids))
    if kind == "bidirectional":
        options = {"bidirectional": True}
        limit = torch.where(pos >= 5, torch.tensor(len(ids)), pos + 1)
    else:
        options = {"frame_size": 4}  # frames [4,8), [8,12), [12,16), [16,17) in absolute positions
        limit = torch.where(pos >= 5, (pos // 4 + 1) * 4, pos + 1).clamp(max=len(ids))
    mask = pos[None, :] < limit[:, None]
    engine = make_engine(ours, num_pages=64, page_size=4, max_num_batched_tokens=4)
    engine.add(Invocation("r", "lm", {"input_ids": ids[:5]}, {}))
    while not engine.step():
        pass
    engine.add(Invocation("r", "lm", {"input_ids": ids[5:]}, options))
    (_, out), = engine.step()  # a block is never chunked, even over the 4-token budget
    torch.testing.assert_close(out["logits"], _dense_logits(ours, ids, mask), atol=1e-4, rtol=1e-4)
    assert not engine.seqs["r", "main"].cacheable


def test_input_embeds_replace_token_embeddings(llama_pair):
    _, ours = llama_pair
    ids = list(range(1, 9))
    embeds = torch.randn(4, ours.config.hidden_size, generator=torch.Generator().manual_seed(1))
    engine = make_engine(ours, num_pages=64, page_size=4)
    engine.add(Invocation("r", "lm", {"input_ids": ids[:4]}, {}))
    engine.step()
    engine.add(Invocation("r", "lm", {"input_ids": ids[4:], "input_embeds": embeds}, {}))
    (_, out), = engine.step()
    with torch.no_grad():
        full = torch.cat([ours.embed(torch.tensor(ids[:4])), embeds])
    expected = _dense_logits(ours, ids, torch.ones(8, 8).tril().bool(), embeds=full)
    torch.testing.assert_close(out["logits"], expected, atol=1e-4, rtol=1e-4)


def test_prefix_cache_evicts_lru_under_pressure(llama_pair):
    _, ours = llama_pair
    engine = make_engine(ours, num_pages=12, page_size=4)
    generate(engine, {"a": list(range(1, 33))}, 1)  # leaves 8 cached full pages
    assert engine.pool.num_cached == 8 and engine.pool.num_used == 0
    generate(engine, {"b": list(range(100, 140))}, 1)  # needs 10 pages: evicts the oldest cached ones
    assert engine.pool.num_used == 0 and engine.pool.num_cached <= 12


def test_pool_pages_are_mapped_at_allocation():
    """The pool is zeroed when made, so no request pays the page faults of first touching its KV pages."""
    import resource

    from mstar_kvcache.pool import PagePool

    if not hasattr(resource, "RUSAGE_THREAD"):
        pytest.skip("needs per-thread rusage (Linux)")
    pool = PagePool(256, 16, 4, 4, 64)  # 32 MiB: 8192 pages of 4 KiB, each a fault if mapped lazily
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    pool.kv.fill_(1.0)
    assert resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before < 100
