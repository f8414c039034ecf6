"""The fp32 linear (fp32_linear.cpp, AVX2 and AVX-512 builds) against a float64 reference, its batch invariance, and PackedLinear's use of it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.nn import fp32_linear
from mstar_core.nn.packed import PackedLinear, pack_linears
from tests.nn._runner_rows import count_runner_rows

# on an AVX-512 CPU the default build is the 16-lane kernel and the `avx2` build the 8-lane one
VARIANTS = [v for v in ("native", "avx2") if fp32_linear.available(v)]
native_only = pytest.mark.skipif(not fp32_linear.available(), reason="no AVX2 and FMA here (or no compiler)")


@pytest.mark.skipif(not VARIANTS, reason="no AVX2 and FMA here (or no compiler)")
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (100, 70), (16, 32), (7, 5)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_float64_and_a_row_is_the_same_whatever_the_row_count(variant, out_features, in_features, bias, threads):
    """Within fp32 rounding of the exact product; every row bitwise equal to that row alone, 1 to 300 rows."""
    gen = torch.Generator().manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(300, in_features + 3, generator=gen)[:, :in_features]  # strided rows
    packed = fp32_linear.pack(weight, variant)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = fp32_linear.linear(x, packed, out_features, b, variant)
        alone = torch.cat([fp32_linear.linear(x[i : i + 1], packed, out_features, b, variant) for i in range(300)])
        for rows in (1, 2, 5, 6, 7, 12, 13, 64, 300):
            assert torch.equal(fp32_linear.linear(x[:rows], packed, out_features, b, variant), alone[:rows]), rows
    finally:
        torch.set_num_threads(before)
    want = F.linear(x.double(), weight.double(), None if b is None else b.double())
    torch.testing.assert_close(got.double(), want, atol=1e-5 * in_features ** 0.5, rtol=1e-5)
    assert torch.equal(got, alone)


@native_only
@pytest.mark.parametrize("threads", [2, 3, 4])
def test_a_call_split_between_threads_computes_every_row_once_with_the_bits_of_one_thread(threads):
    """Near a call's end the threads split runs of panels by row passes (run_panel_tasks): odd run counts (15, 9),
    prompt-sized and decode-sized row counts with a short last pass; every output written once, the same bits as
    one thread's call."""
    gen = torch.Generator().manual_seed(threads)
    before = torch.get_num_threads()
    try:
        for n, k in ((960, 576), (576, 576), (576, 1536), (48, 40)):
            weight = torch.randn(n, k, generator=gen)
            packed = fp32_linear.pack(weight)
            for rows in (13, 32, 119, 121):
                x = torch.randn(rows, k, generator=gen)
                torch.set_num_threads(1)
                one = fp32_linear.linear(x, packed, n, None)
                torch.set_num_threads(threads)
                for _ in range(3):  # (which thread takes which chunk varies from call to call)
                    assert torch.equal(fp32_linear.linear(x, packed, n, None), one), (n, k, rows)
            torch.testing.assert_close(one.double(), x.double() @ weight.double().T, atol=1e-5 * k ** 0.5, rtol=1e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(len(VARIANTS) < 2, reason="one build of the kernel here")
def test_the_avx2_and_avx512_builds_agree_bit_for_bit():
    """One FMA chain per output whatever the vector width: packed differently, the same floats out."""
    gen = torch.Generator().manual_seed(5)
    weight, b = torch.randn(100, 70, generator=gen), torch.randn(100, generator=gen)
    x = torch.randn(37, 70, generator=gen)
    outs = [fp32_linear.linear(x, fp32_linear.pack(weight, v), 100, b, v) for v in VARIANTS]
    assert torch.equal(outs[0], outs[1])


@native_only
def test_packed_fp32_linears_run_every_row_count_on_the_kernel_without_a_onednn_copy(monkeypatch):
    calls = count_runner_rows(monkeypatch, fp32_linear)
    torch.manual_seed(0)
    layer = nn.Linear(64, 200)
    assert pack_linears(layer) == 1 and type(layer) is PackedLinear
    assert layer._packed is None and layer._fast[6] is not None  # the panels replace oneDNN's packed copy
    x = torch.randn(700, 64)
    with torch.inference_mode():
        one, many = layer(x[:1]), layer(x)
    assert calls == [1, 700]
    want = F.linear(x.double(), layer.weight.double(), layer.bias.double()).float()
    torch.testing.assert_close(many, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(one, many[:1])
    with torch.no_grad():
        layer.weight.add_(1)  # a changed weight: never served from the stale panels
    with torch.inference_mode():
        torch.testing.assert_close(layer(x[:4]), F.linear(x[:4], layer.weight, layer.bias), atol=1e-4, rtol=1e-5)
    assert calls == [1, 700]


@native_only
def test_no_panels_for_other_dtypes_or_a_bias_of_another_dtype():
    assert fp32_linear.pack(torch.randn(32, 32).bfloat16()) is None
    assert fp32_linear.pack(torch.randn(32, 32).t()) is None  # (a transposed view: rows not contiguous)
    layer = nn.Linear(32, 32)
    layer.bias = nn.Parameter(layer.bias.double())
    assert pack_linears(layer) == 1 and layer._fast[6] is None and layer._packed is not None
