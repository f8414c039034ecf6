"""The decode-lane kernel's chunked softmax (lane_attention.cpp): a sequence's keys split into chunks, each chunk's
softmax kept unnormalized and merged once, so a lone decoding row's keys spread over the threads. Against torch's
attention math for any split, and the same bits for a row whatever the batch, the threads and the task shape."""

from __future__ import annotations

import pytest
import torch
from mstar_attn_torch import lane_kernel
from mstar_attn_torch.backend import LanePlan, decode_attention

from mstar_core.nn import native

VARIANTS = [v for v in ("native", "avx2", "portable") if lane_kernel.kernel_for(torch.float32, v) is not None]
pytestmark = pytest.mark.skipif(not VARIANTS, reason="no C++ compiler: the kernel cannot be built here")

SCALE = 0.15


def _case(dtype, head_dim, kv_heads, group, bounds, seed, capacity=640):
    """Head-major lanes of random keys, one decoding row per bound (rows and lanes shuffled), each writing its new key
    at bound - 1; q, k, v and a paged pool `[k/v, slots, kv heads, dim]` with a slot per row."""
    gen = torch.Generator().manual_seed(seed)
    lanes, count = len(bounds) + 2, len(bounds)
    store = torch.randn(lanes, 2, kv_heads, capacity, head_dim, generator=gen).to(dtype)
    store_k, store_v = store[:, 0].transpose(1, 2), store[:, 1].transpose(1, 2)
    tokens = count + 1  # (one packed row decodes elsewhere: its output stays untouched)
    q = (3 * torch.randn(tokens, kv_heads * group, head_dim, generator=gen)).to(dtype)  # (peaked softmaxes too)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
    rows = torch.randperm(tokens, generator=gen)[:count]
    lane_ids = torch.randperm(lanes, generator=gen)[:count]
    bound = torch.tensor(bounds)
    plan = LanePlan(rows, lane_ids, bound - 1, lanes, int(bound.max()), None, False, None, bound)
    pool = torch.randn(2, 3 * tokens, kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(3 * tokens, generator=gen)[:tokens]
    return store_k, store_v, q, k, v, plan, pool, slots


def _reference(store_k, store_v, q, k, v, plan):
    """Each row's output by torch ops in fp32 over its lane after the writes."""
    store_k, store_v = store_k.clone(), store_v.clone()
    store_k[plan.lanes, plan.pos], store_v[plan.lanes, plan.pos] = k[plan.rows], v[plan.rows]
    outs = []
    for row, lane, n in zip(plan.rows.tolist(), plan.lanes.tolist(), plan.bound.tolist(), strict=True):
        keys = store_k[lane, :n].transpose(0, 1)[None].float()
        vals = store_v[lane, :n].transpose(0, 1)[None].float()
        outs.append(decode_attention(q[row][None].float(), keys, vals, None, SCALE)[0])
    return torch.stack(outs)


def _run(case, variant, span=0, threads=None, pool=True):
    """The kernel over copies of the case's lanes (and pool): (lanes k, lanes v, pool, out). `span`: keys per chunk
    (0: the kernel's own choice); `threads`: the team (default torch's)."""
    store_k, store_v, q, k, v, plan, pool_kv, slots = case
    store_k, store_v, pool_kv = store_k.clone(), store_v.clone(), pool_kv.clone()
    call = lane_kernel.LaneCall(lane_kernel.kernel_for(q.dtype, variant), plan)
    assert call.fits(q, k, v, store_k)
    out = torch.full_like(q, 7.0)
    k_pool, v_pool = call.prepare(q, k, v, store_k, out, SCALE, (pool_kv[0], pool_kv[1], slots) if pool else None)
    call.plan.span = span
    if threads is not None:
        call.plan.threads = threads
    call.call(q.data_ptr(), k.data_ptr(), v.data_ptr(), store_k.data_ptr(), store_v.data_ptr(), k_pool, v_pool,
              out.data_ptr())
    return store_k, store_v, pool_kv, out


def _close(got, want, dtype):
    if dtype == torch.float32:  # (sums of up to 613 keys in another order than torch's: a few fp32 ulps of ~3)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=4e-6)
    else:  # the fp32 result rounded once to bf16: within one bf16 step of the fp32 reference
        torch.testing.assert_close(got, want, atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,kv_heads,group", [(64, 3, 3), (128, 2, 1), (48, 1, 4)])
def test_any_split_of_the_keys_matches_torch_attention(variant, dtype, head_dim, kv_heads, group):
    """One key, a key count no chunk size divides, and long rows, in chunks of 7 keys, of the kernel's own size, and
    unsplit: each within the reference's tolerance, and no packed row outside the plan written."""
    case = _case(dtype, head_dim, kv_heads, group, [1, 37, 300, 613], seed=head_dim + group)
    want = _reference(*case[:6])
    plan = case[5]
    for span in (7, 0, 1 << 20):
        _, _, _, out = _run(case, variant, span=span)
        _close(out[plan.rows].float(), want, dtype)
        outside = [r for r in range(out.shape[0]) if r not in plan.rows.tolist()]
        assert torch.equal(out[outside], torch.full_like(out[outside], 7.0))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,group", [(64, 5), (64, 4), (128, 3), (256, 2)])
def test_query_heads_weighted_together_match_torch_attention(variant, dtype, head_dim, group):
    """The vector kernels weight the values for several of a group's query heads at once (up to 4 at head dim 64,
    3 at 128, 1 at 256): groups that fill those tiles, and groups split over them (4 + 1, 1 + 1), over key counts
    that end mid-block, each head within the reference's tolerance."""
    case = _case(dtype, head_dim, 2, group, [1, 37, 300], seed=head_dim * group)
    want = _reference(*case[:6])
    plan = case[5]
    for span in (0, 1 << 20):
        _close(_run(case, variant, span=span)[3][plan.rows].float(), want, dtype)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_and_unsplit_agree_with_each_other(variant, dtype):
    """The merge of a row's chunks gives what one pass over all its keys gives (to rounding)."""
    case = _case(dtype, 64, 3, 3, [200, 129, 330], seed=9)
    whole = _run(case, variant, span=1 << 20)[3].float()
    for span in (16, 50, 0):
        _close(_run(case, variant, span=span)[3].float(), whole, dtype)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_has_the_same_bits_on_any_threads_alone_or_in_a_batch(variant, dtype):
    """A lone row's chunks run as tasks spread over the threads, a batch's KV heads as whole tasks: the chunks and
    their merge are the same, so the bits are too (1, 2 or 5 threads; the row alone or beside three others)."""
    case = _case(dtype, 64, 3, 3, [613, 200, 37, 1], seed=4)
    plan = case[5]
    batch = {threads: _run(case, variant, threads=threads) for threads in (1, 2, 5)}
    for threads in (2, 5):
        for got, want in zip(batch[threads], batch[1], strict=True):
            assert torch.equal(got, want)
    for i in range(len(plan.rows)):
        one = LanePlan(plan.rows[i:i + 1], plan.lanes[i:i + 1], plan.pos[i:i + 1], plan.count, plan.width, None, False,
                       None, plan.bound[i:i + 1])
        alone = (*case[:5], one, *case[6:])
        for threads in (1, 2, 5):
            out = _run(alone, variant, threads=threads)[3]
            row = plan.rows[i]
            assert torch.equal(out[row], batch[1][3][row])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_new_key_and_value_is_stored_once_wherever_it_falls(variant, dtype):
    """The chunk holding the write position stores it (the first, a middle, the last chunk), and a write past the
    attended keys (a block mask's bound below the length) is stored by the last chunk: lanes and pool as by torch."""
    case = _case(dtype, 64, 2, 2, [300, 300, 300, 40], seed=6)
    store_k, store_v, q, k, v, plan, pool, slots = case
    pos = torch.tensor([3, 150, 299, 45])  # (the last row attends keys [0, 40) and writes at 45)
    plan = plan._replace(pos=pos)
    case = (store_k, store_v, q, k, v, plan, pool, slots)
    want_k, want_v, want_pool = store_k.clone(), store_v.clone(), pool.clone()
    want_k[plan.lanes, pos], want_v[plan.lanes, pos] = k[plan.rows], v[plan.rows]
    want_pool[0, slots[plan.rows]], want_pool[1, slots[plan.rows]] = k[plan.rows], v[plan.rows]
    for span in (16, 0):
        got_k, got_v, got_pool, out = _run(case, variant, span=span, threads=2)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v) and torch.equal(got_pool, want_pool)
        _close(out[plan.rows].float(), _reference(*case[:6]), dtype)


def test_the_kernel_picks_its_chunks_by_key_count(monkeypatch):
    """The kernel's own chunk size: a lone SmolLM2 row's 3 KV heads at 200 keys are 6 tasks of whole vector blocks,
    so 2 threads share them evenly (checked through the results: the default equals an explicit 112-key split)."""
    monkeypatch.setenv(native.SWITCH_ENV, VARIANTS[0])
    case = _case(torch.float32, 64, 3, 3, [200], seed=2)
    assert torch.equal(_run(case, VARIANTS[0], span=0)[3], _run(case, VARIANTS[0], span=112)[3])
    assert not torch.equal(_run(case, VARIANTS[0], span=0)[3], _run(case, VARIANTS[0], span=1 << 20)[3])


def test_a_decode_steps_plan_is_one_index_tensor_and_builds_no_views_for_the_kernel():
    """The backend's per-step plan: each row's packed row, lane, write position and bound in one int64 tensor (the
    kernel's and a replay's), and the lanes' window views built only where torch ops attend (never for the kernel)."""
    from mstar_attn_torch.backend import TorchPagedAttention
    from mstar_kvcache.batch import PagedBatch

    page, kv = 4, torch.randn(2, 2, 64, 4, 2, 16)  # [layers, k/v, pages, page size, kv heads, dim] (room for lanes)
    backend = TorchPagedAttention("cpu")

    def step(kv_lens, page_lists):
        count = len(kv_lens)
        slots = [pages[(n - 1) // page] * page + (n - 1) % page for pages, n in zip(page_lists, kv_lens, strict=True)]
        table = torch.tensor([pages + [0] * (3 - len(pages)) for pages in page_lists])
        batch = PagedBatch(page_size=page, q_lens=[1] * count, kv_lens=kv_lens, q_start=torch.arange(count + 1),
                           positions=torch.tensor([n - 1 for n in kv_lens]), slot_mapping=torch.tensor(slots),
                           page_table=table, page_lists=page_lists, seq_ids=[10 + i for i in range(count)],
                           row_starts=list(range(count + 1)))
        return backend.begin(batch, kv)

    ctx = step([5, 9, 3], [[0, 1], [2, 3, 4], [5]])
    assert ctx.kernel is not None and ctx.replay_layout() is not None
    want = torch.tensor([[0, 1, 2], [0, 1, 2], [4, 8, 2], [5, 9, 3]])
    assert torch.equal(ctx.kernel.index, want) and ctx.kernel.index.dtype == torch.int64
    assert ctx._windows is None
    q, k, v = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    out = ctx.attend(0, q, k, v, 0.25)
    assert out.shape == q.shape and ctx._windows is None  # (the kernel took the layer: no views)
    window_k, window_v = ctx.lane_windows  # (the torch path's: built on demand, over the plan's lanes and width)
    assert window_k.shape == (2, 3, 2, 9, 16) and torch.equal(window_k[0, 1, :, 8], k[1])
    assert torch.equal(window_v[0, 1, :, 8], v[1])
    after = step([6, 10], [[0, 1], [2, 3, 4]])  # (the next step: new lengths; the third sequence left)
    assert torch.equal(after.kernel.index, torch.tensor([[0, 1], [0, 1], [5, 9], [6, 10]]))
