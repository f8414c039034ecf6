"""The AVX512-BF16 linear (bf16_linear.cpp) against a float64 reference, its batch invariance, and PackedLinear's use of it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.nn import amx_linear, bf16_linear
from mstar_core.nn.packed import PackedLinear, pack_linears
from tests.nn._runner_rows import count_runner_rows

pytestmark = pytest.mark.skipif(not bf16_linear.available(), reason="no AVX512-BF16 on this CPU (or no compiler)")
#: PackedLinear takes the AMX kernel first where the CPU has tiles
panels_first = pytest.mark.skipif(amx_linear.available(), reason="this CPU has AMX: bf16 layers take the tiles")


@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (100, 70), (33, 3), (7, 1)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_float64_and_a_row_is_the_same_whatever_the_row_count(out_features, in_features, bias, threads):
    """Within one bf16 rounding of the exact product; every row bitwise equal to that row alone, 1 to 300 rows."""
    gen = torch.Generator().manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    x = torch.randn(300, in_features + 3, generator=gen).bfloat16()[:, :in_features]  # strided rows
    packed = bf16_linear.pack(weight)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = bf16_linear.linear(x, packed, out_features, b)
        alone = torch.cat([bf16_linear.linear(x[i : i + 1], packed, out_features, b) for i in range(300)])
        for rows in (1, 2, 11, 12, 13, 24, 25, 64, 300):
            assert torch.equal(bf16_linear.linear(x[:rows], packed, out_features, b), alone[:rows]), rows
    finally:
        torch.set_num_threads(before)
    want = F.linear(x.double(), weight.double(), None if b is None else b.double())
    # fp32 sums of exact bf16 products (the order is the only difference), then one rounding to bf16
    torch.testing.assert_close(got.double(), want, atol=1e-5 * in_features ** 0.5, rtol=2 ** -8)
    assert torch.equal(got, alone)


@panels_first
def test_packed_bf16_linears_run_every_row_count_on_the_kernel_without_a_onednn_copy(monkeypatch):
    calls = count_runner_rows(monkeypatch, bf16_linear)
    torch.manual_seed(0)
    layer = nn.Linear(64, 200).bfloat16()
    assert pack_linears(layer) == 1 and type(layer) is PackedLinear
    assert layer._packed is None and layer._fast[6] is not None  # the panels replace oneDNN's packed copy
    x = torch.randn(700, 64).bfloat16()
    with torch.inference_mode():
        one, many = layer(x[:1]), layer(x)
    assert calls == [1, 700]
    want = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    torch.testing.assert_close(many.double(), want, atol=1e-4, rtol=2 ** -8)
    assert torch.equal(one, many[:1])
    with torch.no_grad():
        layer.weight.add_(1)  # a changed weight: never served from the stale panels
    with torch.inference_mode():
        torch.testing.assert_close(layer(x[:4]).float(), F.linear(x[:4].float(), layer.weight.float(), layer.bias.float()),
                                   atol=0.1, rtol=1e-2)
    assert calls == [1, 700]


def test_no_panels_for_other_dtypes_or_layouts():
    assert bf16_linear.pack(torch.randn(32, 32)) is None
    assert bf16_linear.pack(torch.randn(32, 32).bfloat16().t()) is None  # (a transposed view: rows not contiguous)


@pytest.mark.parametrize("threads", [3, 17])  # (17: more threads than cores and than the ranges kept inline)
@pytest.mark.parametrize("out_features,in_features,rows", [(960, 576, 1), (3072, 576, 5), (576, 1536, 37), (64, 96, 113)])
def test_any_thread_count_gives_the_one_thread_bits(out_features, in_features, rows, threads):
    """Each thread's own range of panels, the back of another's taken when out of work: the bits of one thread.

    Oversubscribed (more threads than cores), threads are held up and take panels from one another's ranges; fewer
    panels than threads leaves threads without a range (64 outputs: 2 panels).
    """
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    packed = bf16_linear.pack(weight)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = bf16_linear.linear(x, packed, out_features, b)
        torch.set_num_threads(threads)
        for _ in range(3):
            assert torch.equal(bf16_linear.linear(x, packed, out_features, b), alone)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(alone.double(), F.linear(x.double(), weight.double(), b.double()),
                               atol=1e-5 * in_features ** 0.5, rtol=2 ** -8)
