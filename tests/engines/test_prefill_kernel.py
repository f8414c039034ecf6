"""The CPU prefill attention kernel (mstar_attn_torch/prefill_attention.cpp) against dense causal attention."""

from __future__ import annotations

import pytest
import torch
from mstar_attn_torch import TorchPagedAttention, prefill_kernel
from mstar_kvcache.batch import build_batch
from mstar_kvcache.sequence import Sequence

pytestmark = pytest.mark.skipif(prefill_kernel.kernel_for(torch.float32) is None,
                                reason="the prefill kernel computes on AVX-512 builds only")


def _dense(q, k, v, prefix, scale, dtype=torch.float32):
    """Row r of `q` over keys [0, prefix + r], in fp32 (or `dtype`)."""
    n, group = q.shape[0], q.shape[1] // k.shape[1]
    keys = k.to(dtype).repeat_interleave(group, 1).transpose(0, 1)
    vals = v.to(dtype).repeat_interleave(group, 1).transpose(0, 1)
    scores = q.to(dtype).transpose(0, 1) @ keys.transpose(1, 2) * scale
    seen = torch.arange(k.shape[0])[None, :] <= (prefix + torch.arange(n))[:, None]
    return (torch.softmax(scores.masked_fill(~seen, float("-inf")), -1) @ vals).transpose(0, 1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows,prefix,heads,kv_heads,dim", [
    (1, 0, 9, 3, 64),      # one row: a single key
    (5, 0, 9, 3, 64),      # fewer rows than a task's block
    (94, 0, 9, 3, 64),     # SmolLM2's shape: tasks of 8 rows, a ragged last one
    (33, 17, 8, 2, 128),   # after cached keys; two output tiles of dimensions
    (200, 40, 4, 4, 64),   # no grouping; many key tiles
    (70, 0, 24, 1, 64),    # one KV head for 24 query heads: one row a task
])
def test_kernel_matches_dense_causal_attention(dtype, tol, rows, prefix, heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(rows + prefix)
    # q, k and v as views of one fused projection's output, as a layer hands them over (rows strided)
    fused = torch.randn(prefix + rows, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    q, k, v = fused[prefix:, :heads], fused[:, heads : heads + kv_heads], fused[:, heads + kv_heads :]
    out = torch.full((rows, heads, dim), float("nan"), dtype=dtype)
    assert prefill_kernel.attend(q, k, v, out, prefix, dim**-0.5)
    torch.testing.assert_close(out.float(), _dense(q, k, v, prefix, dim**-0.5), atol=tol, rtol=tol)


def test_kernel_refuses_what_it_does_not_take():
    q, kv = torch.randn(4, 4, 32), torch.randn(4, 2, 32)
    assert not prefill_kernel.attend(q, kv, kv, torch.empty_like(q), 0, 1.0)  # head dim not a multiple of 64
    q, kv = torch.randn(4, 4, 64), torch.randn(4, 2, 64)
    assert not prefill_kernel.attend(q, kv, kv, torch.empty_like(q), 1, 1.0)  # keys are not prefix + rows
    assert not prefill_kernel.attend(q, kv.half(), kv.half(), torch.empty_like(q), 0, 1.0)  # mixed dtypes
    assert not prefill_kernel.attend(q.half(), kv.half(), kv.half(), torch.empty_like(q).half(), 0, 1.0)  # fp16


PAGE, HQ, HKV, DIM = 16, 6, 2, 64


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("before,new", [([0, 0], [37, 20]), ([21, 0, 5], [40, 9, 1])])
def test_backend_prefills_through_the_kernel(monkeypatch, dtype, tol, before, new):
    """Fresh prompts and chunks after cached keys (scattered pages) take the kernel and match dense attention."""
    taken = []
    attend = prefill_kernel.attend
    monkeypatch.setattr(prefill_kernel, "attend", lambda *a, **kw: taken.append(attend(*a, **kw)) or taken[-1])
    call = prefill_kernel.PromptCalls.__call__

    def prompt_calls(self, *a):  # (a step of fresh prompts only: every chunk through the first layer's plans)
        out = call(self, *a)
        taken.extend([out is not None] * len(self.calls))
        return out

    monkeypatch.setattr(prefill_kernel.PromptCalls, "__call__", prompt_calls)
    pages = torch.randperm(32, generator=torch.Generator().manual_seed(0)).tolist()
    work = []
    for i, (old, n) in enumerate(zip(before, new, strict=True)):
        seq = Sequence(f"r{i}", "main", tokens=[1] * (old + n), num_computed=old, order=i)
        seq.pages = [pages.pop() for _ in range(-(-(old + n) // PAGE))]
        work.append((seq, n))
    gen = torch.Generator().manual_seed(1)
    full = [[torch.randn(s.num_computed + n, h, DIM, generator=gen).to(dtype) for h in (HQ, HKV, HKV)] for s, n in work]
    kv = torch.zeros(1, 2, 32, PAGE, HKV, DIM, dtype=dtype)
    for (seq, _), (_, k, v) in zip(work, full, strict=True):  # the earlier tokens' keys already in their pages
        for p in range(seq.num_computed):
            kv[0, 0, seq.pages[p // PAGE], p % PAGE], kv[0, 1, seq.pages[p // PAGE], p % PAGE] = k[p], v[p]
    _, batch = build_batch(work, PAGE, torch.device("cpu"))
    q, k, v = (torch.cat([f[j][s.num_computed :] for (s, _), f in zip(work, full, strict=True)]) for j in range(3))
    out = TorchPagedAttention("cpu").begin(batch, kv).attend(0, q, k, v, DIM**-0.5)
    ref = torch.cat([_dense(fq[s.num_computed :], fk, fv, s.num_computed, DIM**-0.5)
                     for (s, _), (fq, fk, fv) in zip(work, full, strict=True)])
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    assert taken and all(taken), taken  # every chunk of more than one row ran the kernel
    assert len(taken) == sum(1 for n in new if n > 1)


def test_bf16_kernel_is_nearer_exact_attention_than_torchs():
    """bf16 outputs differ from torch's kernel by a rounding step in ~1 of 5 elements (so bf16 greedy texts may part
    from torch-based servers'); against attention in float64 over the same bf16 inputs the kernel is the nearer."""
    import torch.nn.functional as F

    fused = (torch.randn(94, 15, 64, generator=torch.Generator().manual_seed(3)) * 2).bfloat16()
    q, k, v = fused[:, :9], fused[:, 9:12], fused[:, 12:]
    out = torch.empty(94, 9, 64, dtype=torch.bfloat16)
    assert prefill_kernel.attend(q, k, v, out, 0, 0.125)
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
    theirs = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=0.125, enable_gqa=True)[0].transpose(0, 1)
    exact = F.scaled_dot_product_attention(qh.double(), kh.double(), vh.double(), is_causal=True, scale=0.125,
                                           enable_gqa=True)[0].transpose(0, 1)
    ours_err, theirs_err = ((o.double() - exact).abs().mean().item() for o in (out, theirs))
    assert ours_err <= theirs_err, (ours_err, theirs_err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,prefix", [(1, 0), (37, 0), (21, 9)])
def test_kernel_stores_the_chunks_keys_and_values_at_their_slots(dtype, rows, prefix):
    """With `store`, the chunk's own keys and values (the last `rows`) land at their pool slots, bit for bit, and no
    other slot is touched; the attention is the same as without it."""
    gen = torch.Generator().manual_seed(rows)
    fused = torch.randn(prefix + rows, 9 + 2 * 3, 64, generator=gen).to(dtype)
    q, k, v = fused[prefix:, :9], fused[:, 9:12], fused[:, 12:]
    pool = torch.full((2, 80, 3, 64), float("nan"), dtype=dtype)
    slots = torch.randperm(80, generator=gen)[:rows]
    out, plain = torch.empty(rows, 9, 64, dtype=dtype), torch.empty(rows, 9, 64, dtype=dtype)
    assert prefill_kernel.attend(q, k, v, out, prefix, 0.125, store=(pool[0], pool[1], slots))
    assert prefill_kernel.attend(q, k, v, plain, prefix, 0.125)
    assert torch.equal(out, plain)
    assert torch.equal(pool[0, slots], k[prefix:]) and torch.equal(pool[1, slots], v[prefix:])
    untouched = torch.ones(80, dtype=torch.bool)
    untouched[slots] = False
    assert pool[:, untouched].isnan().all()
    # a pool it cannot write (another dtype, or slots of another length): refused, nothing written
    other = torch.zeros(2, 80, 3, 64, dtype=torch.float16)
    assert not prefill_kernel.attend(q, k, v, out, prefix, 0.125, store=(other[0], other[1], slots))
    assert not prefill_kernel.attend(q, k, v, out, prefix, 0.125, store=(pool[0], pool[1], slots[:-1] if rows > 1
                                                                         else slots.repeat(2)))
    assert not other.any()


@pytest.mark.parametrize("declined", [False, True])
def test_a_prompt_step_writes_every_key_and_value_to_its_page(monkeypatch, declined):
    """A step of fresh prompts stores keys and values through the kernel (no page write before it); where the kernel
    declines a chunk, the backend writes it: either way each row's key and value are at its slot, bit for bit."""
    attend = prefill_kernel.attend
    monkeypatch.setattr(prefill_kernel, "attend", (lambda *a, **kw: False) if declined else attend)
    if declined:
        monkeypatch.setattr(prefill_kernel.PromptCalls, "build", lambda *a, **kw: None)
    work = []
    pages = torch.randperm(32, generator=torch.Generator().manual_seed(4)).tolist()
    for i, n in enumerate([29, 40]):
        seq = Sequence(f"r{i}", "main", tokens=[1] * n, num_computed=0, order=i)
        seq.pages = [pages.pop() for _ in range(-(-n // PAGE))]
        work.append((seq, n))
    _, batch = build_batch(work, PAGE, torch.device("cpu"))
    fused = torch.randn(69, HQ + 2 * HKV, DIM, generator=torch.Generator().manual_seed(5))
    q, k, v = fused[:, :HQ], fused[:, HQ : HQ + HKV], fused[:, HQ + HKV :]
    kv = torch.full((1, 2, 32, PAGE, HKV, DIM), float("nan"))
    context = TorchPagedAttention("cpu").begin(batch, kv)
    assert context.prompts_only
    context.attend(0, q, k, v, DIM**-0.5)
    flat = kv.view(2, -1, HKV, DIM)
    assert torch.equal(flat[0, batch.slot_mapping], k) and torch.equal(flat[1, batch.slot_mapping], v)
    assert flat.isnan().all(-1).all(-1).sum() == flat.shape[0] * flat.shape[1] - 2 * 69  # nothing else written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_calls_are_each_layers_per_chunk_calls(dtype):
    """A prompt step's layers after the first reuse its plans (`PromptCalls`): every layer's output and page writes
    bitwise what `attend` gives chunk by chunk, each layer into its own pool; a layer laid out otherwise (another
    stride) gets plans of its own."""
    lengths = [29, 40, 2]
    work, pages = [], torch.randperm(32, generator=torch.Generator().manual_seed(6)).tolist()
    for i, n in enumerate(lengths):
        seq = Sequence(f"r{i}", "main", tokens=[1] * n, num_computed=0, order=i)
        seq.pages = [pages.pop() for _ in range(-(-n // PAGE))]
        work.append((seq, n))
    _, batch = build_batch(work, PAGE, torch.device("cpu"))
    layers, rows = 3, sum(lengths)
    kv = torch.full((layers, 2, 32, PAGE, HKV, DIM), float("nan"), dtype=dtype)
    want_kv = kv.clone()
    context = TorchPagedAttention("cpu").begin(batch, kv)
    assert context.prompts_only
    gen = torch.Generator().manual_seed(7)
    for layer in range(layers):
        width = HQ + 2 * HKV + (1 if layer == 2 else 0)  # (the last layer's rows further apart: its own plans)
        fused = torch.randn(rows, width, DIM, generator=gen).to(dtype)
        q, k, v = fused[:, :HQ], fused[:, HQ : HQ + HKV], fused[:, HQ + HKV : HQ + 2 * HKV]
        got = context.attend(layer, q, k, v, DIM**-0.5)
        want = torch.empty(rows, HQ, DIM, dtype=dtype)
        flat = want_kv[layer].view(2, -1, HKV, DIM)
        start = 0
        for n in lengths:
            chunk = slice(start, start + n)
            assert prefill_kernel.attend(q[chunk], k[chunk], v[chunk], want[chunk], 0, DIM**-0.5,
                                         store=(flat[0], flat[1], batch.slot_mapping[chunk]))
            start += n
        assert torch.equal(got, want)
    assert torch.equal(kv.isnan(), want_kv.isnan()) and torch.equal(kv.nan_to_num(), want_kv.nan_to_num())


@pytest.mark.parametrize("rows,prefix,heads,kv_heads,dim", [(94, 0, 9, 3, 64), (33, 17, 8, 2, 128), (200, 0, 4, 4, 64)])
def test_bf16_scores_from_pairs_stay_within_a_rounding_of_the_fp32_tiles(rows, prefix, heads, kv_heads, dim):
    """Where AVX512-BF16 is built a bf16 chunk's scores add pairs of exact products (`vdpbf16ps`) instead of one FMA a
    dimension: its outputs are the fp32 tiles' over the same (widened) inputs, rounded to bf16, in all but a few
    elements, those about a rounding step apart, and as near attention in float64."""
    gen = torch.Generator().manual_seed(rows + dim)
    fused = (torch.randn(prefix + rows, heads + 2 * kv_heads, dim, generator=gen) * 2).bfloat16()
    q, k, v = fused[prefix:, :heads], fused[:, heads : heads + kv_heads], fused[:, heads + kv_heads :]
    out = torch.empty(rows, heads, dim, dtype=torch.bfloat16)
    wide = torch.empty(rows, heads, dim)
    assert prefill_kernel.attend(q, k, v, out, prefix, dim**-0.5)
    assert prefill_kernel.attend(q.float(), k.float(), v.float(), wide, prefix, dim**-0.5)
    want = wide.bfloat16()
    apart = out != want
    assert apart.float().mean() <= 0.005
    # a rounding step at each value, or (outputs near zero, where the rows' weighted values cancel) 2^-12 of inputs of
    # unit scale
    assert ((out.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 2**-12).all()
    exact = _dense(q, k, v, prefix, dim**-0.5, torch.float64)
    assert (out.double() - exact).abs().mean() <= (want.double() - exact).abs().mean() * 1.01
