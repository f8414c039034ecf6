"""The encoder self-attention kernel (`mstar_core.nn.encoder_attention`, `encoder_attention.cpp`) against torch's
`scaled_dot_product_attention`, at each vector build, at frame counts off its query blocks and key steps, reading q,
k and v in place from a fused projection's strided chunks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mstar_core.nn import encoder_attention, native_build

pytestmark = pytest.mark.skipif(encoder_attention._function("native") is None,
                                reason="the kernel is not built here (no compiler)")


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, scale: float | None = None) -> torch.Tensor:
    b, t, d = q.shape
    split = [x.reshape(b, t, heads, d // heads).transpose(1, 2) for x in (q, k, v)]
    return F.scaled_dot_product_attention(*split, scale=scale).transpose(1, 2).reshape(b, t, d)


def _variants():
    return [v for v in ("avx512", "avx2") if v in native_build.BY_NAME]


@pytest.mark.parametrize("variant", _variants())
@pytest.mark.parametrize(("windows", "frames", "heads", "dim"),
                         [(2, 37, 3, 64), (1, 1, 2, 64), (1, 97, 1, 128), (3, 49, 2, 64), (1, 1500, 2, 64)])
def test_matches_sdpa_on_the_fused_projections_chunks(variant, windows, frames, heads, dim):
    g = torch.Generator().manual_seed(frames)
    # scores of a few units (as a trained encoder's), so the softmax is peaked rather than flat
    qkv = torch.randn(windows, frames, 3 * heads * dim, generator=g) * 1.5
    q, k, v = qkv.chunk(3, dim=-1)  # (row stride 3 x width: the kernel reads them in place)
    got = encoder_attention.attend(q, k, v, heads, variant=variant)
    if got is None:
        pytest.skip(f"no {variant} vector code for this CPU")
    want = _sdpa(q, k, v, heads)
    assert got.is_contiguous() and got.shape == want.shape
    # within 1e-5 of the largest output (the two sum the same products in different orders)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_takes_its_own_scale_and_separate_tensors():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 61, 128, generator=g) for _ in range(3))
    got = encoder_attention.attend(q, k, v, 2, scale=0.3, variant="native")
    assert got is not None
    want = _sdpa(q, k, v, 2, scale=0.3)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_a_window_gets_the_same_bits_alone_batched_and_on_one_thread():
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(3, 53, 3 * 128, generator=g)
    q, k, v = qkv.chunk(3, dim=-1)
    batched = encoder_attention.attend(q, k, v, 2, variant="native")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = encoder_attention.attend(q[1:2], k[1:2], v[1:2], 2, variant="native")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batched[1:2], alone)


def test_leaves_what_it_does_not_take_to_torch():
    x = torch.randn(1, 8, 128)
    assert encoder_attention.attend(x, x, x, 4, variant="native") is None  # head dim 32: not a multiple of 64
    assert encoder_attention.attend(x.double(), x.double(), x.double(), 2, variant="native") is None
    assert encoder_attention.attend(x, x, x.transpose(1, 2).contiguous().transpose(1, 2), 2, variant="native") is None
    y = x.clone().requires_grad_(True)
    assert encoder_attention.attend(y, x, x, 2, variant="native") is None
    if "portable" in native_build.BY_NAME:
        assert encoder_attention.attend(x, x, x, 2, variant="portable") is None  # (no vector code: torch's)
