"""The paged cross-attention kernel (`mstar_core.nn.cross_attention.PagedCrossKernel`, `cross_attention.cpp`) that a
Whisper decoder step runs over its encoder keys in pool pages: torch's attention over the same keys (scattered pages,
frame counts off the 16-frame blocks, grouped heads, the AVX-512 head dims and the generic loop), each sequence the
same bits alone or batched, and the step context routing long prompts to torch while the rest take the kernel."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from mstar_core.nn import native_build
from mstar_core.nn.cross_attention import KERNEL_MAX_ROWS, PagedCrossKernel, cross_kernel

PAGE = 16
pytestmark = pytest.mark.skipif(cross_kernel() is None, reason="the kernel is not built here (no compiler)")


def _pool(pages: int, heads: int, dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    kv = torch.randn(2, pages * PAGE, heads, dim, generator=torch.Generator().manual_seed(seed))
    return kv[0], kv[1]  # [slots, kv heads, head dim], as a pool layer's keys and values


def _reference(q, keys, values, frames, pages, scale):
    slots = (torch.tensor(pages).repeat_interleave(PAGE) * PAGE + torch.arange(PAGE).repeat(len(pages)))[:frames]
    k, v = keys[slots].transpose(0, 1), values[slots].transpose(0, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[0])
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("variant", [None, "avx2", "portable"])
@pytest.mark.parametrize(("q_heads", "kv_heads", "dim"), [(8, 8, 64), (4, 2, 128), (3, 3, 24)])
def test_each_sequence_matches_torch_attention_over_its_pages(variant, q_heads, kv_heads, dim):
    if variant is not None and variant not in native_build.BY_NAME:
        pytest.skip(f"no {variant} level on this architecture")
    keys, values = _pool(40, kv_heads, dim)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(1)).tolist()
    # (first row, rows, frames, pages): scattered pages, a frame count off the 16-frame blocks, a prompt of 5 rows
    spans = [(0, 1, 203, order[:13]), (1, 5, 37, order[13:16]), (6, KERNEL_MAX_ROWS, 16, order[16:17])]
    q = torch.randn(6 + KERNEL_MAX_ROWS, q_heads, dim, generator=torch.Generator().manual_seed(2))
    kernel = PagedCrossKernel.for_spans(spans, PAGE, variant)
    assert kernel is not None and kernel.fits(q, keys, values)
    out = torch.full_like(q, float("nan"))
    kernel(q, keys, values, out, dim**-0.5)
    for row, rows, frames, pages in spans:
        want = _reference(q[row : row + rows], keys, values, frames, pages, dim**-0.5)
        torch.testing.assert_close(out[row : row + rows], want, atol=2e-6, rtol=1e-5)


def test_a_sequence_attends_the_same_bits_alone_or_batched():
    keys, values = _pool(200, 8, 64)
    spans = [(i, 1, 1500 - 37 * i, list(range(94 * i % 100, 94 * i % 100 + 94))) for i in range(2)]
    q = torch.randn(2, 8, 64)
    together = torch.empty_like(q)
    PagedCrossKernel.for_spans(spans, PAGE)(q, keys, values, together, 0.125)
    for i, (_, _, frames, pages) in enumerate(spans):
        alone = torch.empty(1, 8, 64)
        PagedCrossKernel.for_spans([(0, 1, frames, pages)], PAGE)(q[i : i + 1], keys, values, alone, 0.125)
        assert torch.equal(alone, together[i : i + 1])


def test_more_rows_than_the_kernel_takes_are_refused():
    with pytest.raises(ValueError, match="rows per sequence"):
        PagedCrossKernel.for_spans([(0, KERNEL_MAX_ROWS + 1, 32, [0, 1])], PAGE)


def test_a_step_runs_long_prompts_through_torch_and_the_rest_through_the_kernel():
    from mstar_kvcache.cross import CrossAttentionContext, CrossLabels
    from mstar_kvcache.pool import PagePool

    layers, heads, dim, hidden = 2, 4, 16, 64
    pool = PagePool(64, PAGE, layers, heads, dim)
    weights = torch.randn(layers, 2, hidden, hidden, generator=torch.Generator().manual_seed(3)) / 8

    def cross_kv(states):  # [B, F, hidden] -> [B, layers, 2, F, heads, dim]
        return torch.einsum("bfh,lkoh->blkfo", states, weights).unflatten(-1, (heads, dim))

    labels = CrossLabels("dec", types.SimpleNamespace(cross_kv=cross_kv), pool, torch.device("cpu"))
    states = {rid: torch.randn(frames, hidden, generator=torch.Generator().manual_seed(i))
              for i, (rid, frames) in enumerate((("a", 150), ("b", 61)))}
    for rid, s in states.items():
        labels.queue(types.SimpleNamespace(request_id=rid), types.SimpleNamespace(cross_states=s, cross_label="audio"))
    ready, failed = labels.store_waiting()
    assert len(ready) == 2 and not failed
    seqs = [types.SimpleNamespace(request_id=rid, cross_label="audio") for rid in ("a", "b")]
    work = [(seqs[0], 1), (seqs[1], KERNEL_MAX_ROWS + 4)]  # a decode row, then a prompt too long for the kernel
    context = labels.context(work, inner=None)
    assert isinstance(context, CrossAttentionContext) and context.kernel is not None
    assert [n for _, n, _ in context.spans] == [KERNEL_MAX_ROWS + 4]  # (only the prompt left to torch)
    q = torch.randn(1 + KERNEL_MAX_ROWS + 4, heads, dim)
    for layer in range(layers):
        out = context.cross_attend(layer, q, dim**-0.5)
        start = 0
        for (_, n), rid in zip(work, ("a", "b"), strict=True):
            kv = cross_kv(states[rid][None])[0, layer]  # [2, F, heads, dim]
            want = F.scaled_dot_product_attention(q[start : start + n].transpose(0, 1)[None], kv[0].transpose(0, 1)[None],
                                                  kv[1].transpose(0, 1)[None], scale=dim**-0.5)[0].transpose(0, 1)
            torch.testing.assert_close(out[start : start + n], want, atol=2e-6, rtol=1e-5)
            start += n
