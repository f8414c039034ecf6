"""Attention backends against the dense reference: mixed decode/prefill batches over scattered pages."""

from __future__ import annotations

import pytest
import torch
from mstar_attn_torch import TorchPagedAttention
from mstar_kvcache.batch import build_batch
from mstar_kvcache.sequence import Sequence

from mstar_core.nn.attention import DenseAttention

PAGE, HQ, HKV, DIM = 4, 4, 2, 8


def _layout(lens_before, lens_new, limits_for=None):
    """Sequences with shuffled page tables, already holding `lens_before` tokens."""
    pages = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()
    work = []
    for i, (old, new) in enumerate(zip(lens_before, lens_new, strict=True)):
        seq = Sequence(f"r{i}", "main", tokens=[1] * (old + new), num_computed=old, order=i)
        seq.pages = [pages.pop() for _ in range(-(-(old + new) // PAGE))]
        if limits_for is not None and i == limits_for:
            seq.limits = list(range(1, old + 1)) + [old + new] * new  # the new tokens form one block
        work.append((seq, new))
    return work


def _run(backend_cls, device, work):
    gen = torch.Generator().manual_seed(1)
    total = [s.num_computed + n for s, n in work]
    full = [(torch.randn(t, HQ, DIM, generator=gen), torch.randn(t, HKV, DIM, generator=gen),
             torch.randn(t, HKV, DIM, generator=gen)) for t in total]
    kv = torch.zeros(1, 2, 64, PAGE, HKV, DIM, device=device)
    for (seq, _), (_, k, v) in zip(work, full, strict=True):  # earlier tokens already in the pages
        for p in range(seq.num_computed):
            kv[0, 0, seq.pages[p // PAGE], p % PAGE] = k[p]
            kv[0, 1, seq.pages[p // PAGE], p % PAGE] = v[p]
    _, batch = build_batch(work, PAGE, torch.device(device))
    new = [tuple(x[s.num_computed :] for x in f) for (s, _), f in zip(work, full, strict=True)]
    q, k, v = (torch.cat([n[j] for n in new]).to(device) for j in range(3))
    out = backend_cls(device).begin(batch, kv).attend(0, q, k, v, DIM**-0.5).cpu()
    refs = []
    for (seq, n), (fq, fk, fv) in zip(work, full, strict=True):
        pos = torch.arange(fq.shape[0])
        limit = torch.tensor(seq.limits) if seq.limits is not None else pos + 1
        ref = DenseAttention(mask=pos[None, :] < limit[:, None]).attend(0, fq, fk, fv, DIM**-0.5)
        refs.append(ref[-n:])
    return out, torch.cat(refs)


@pytest.mark.parametrize(
    "before,new,block",
    [([5, 9, 0, 13], [1, 1, 1, 1], None), ([0, 7, 3, 12], [6, 1, 5, 1], None), ([3, 8], [5, 1], 0)],
)
def test_torch_backend_matches_dense(before, new, block):
    out, ref = _run(TorchPagedAttention, "cpu", _layout(before, new, block))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("before,new,block", [([5, 9, 0, 13], [1, 1, 1, 1], None), ([0, 7, 3, 12], [6, 1, 5, 1], None)])
def test_flashinfer_matches_torch(before, new, block):
    pytest.importorskip("flashinfer")
    from mstar_attn_flashinfer import FlashInferPagedAttention

    fi, ref = _run(FlashInferPagedAttention, "cuda", _layout(before, new, block))
    torch.testing.assert_close(fi, ref, atol=2e-3, rtol=2e-3)
    ours, _ = _run(TorchPagedAttention, "cuda", _layout(before, new, block))
    torch.testing.assert_close(fi, ours, atol=2e-3, rtol=2e-3)
