"""The AMX bf16 linear (amx_linear.cpp) against F.linear, its batch invariance, and PackedLinear's use of it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.nn import amx_linear
from mstar_core.nn.packed import PackedLinear, pack_linears
from tests.nn._runner_rows import count_runner_rows

pytestmark = pytest.mark.skipif(not amx_linear.available(), reason="no AMX tiles on this CPU (or no compiler)")


@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (100, 70), (16, 32), (48, 100)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear_and_a_row_is_the_same_whatever_the_row_count(out_features, in_features, bias):
    """fp32 sums rounded once to bf16; every row bitwise equal to that row alone, for 1..32 rows (edges padded)."""
    gen = torch.Generator().manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    x = torch.randn(32, in_features + 3, generator=gen).bfloat16()[:, :in_features]  # strided rows
    tiles = amx_linear.pack(weight)
    got = amx_linear.linear(x, tiles, out_features, b)
    want = F.linear(x.float(), weight.float(), None if b is None else b.float())
    torch.testing.assert_close(got.float(), want, atol=1e-2 * want.abs().max().item(), rtol=1e-2)
    alone = torch.cat([amx_linear.linear(x[i : i + 1], tiles, out_features, b) for i in range(32)])
    for rows in (1, 2, 15, 16, 17, 31, 32):
        assert torch.equal(amx_linear.linear(x[:rows], tiles, out_features, b), alone[:rows]), rows


def test_packed_bf16_linears_run_decode_rows_on_the_tiles_and_longer_calls_on_onednn(monkeypatch):
    calls = count_runner_rows(monkeypatch, amx_linear)
    torch.manual_seed(0)
    layer = nn.Linear(64, 200).bfloat16()
    assert pack_linears(layer) == 1 and type(layer) is PackedLinear
    x = torch.randn(40, 64).bfloat16()
    with torch.inference_mode():
        few, many = layer(x[:amx_linear.MAX_ROWS]), layer(x)
    assert calls == [amx_linear.MAX_ROWS]  # 40 rows went to oneDNN
    want = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    for got, ref in ((few, want[: amx_linear.MAX_ROWS]), (many, want)):
        torch.testing.assert_close(got.float(), ref, atol=1e-2 * ref.abs().max().item(), rtol=1e-2)
    with torch.no_grad():
        layer.weight.add_(1)  # a changed weight: never served from the stale tiles
    with torch.inference_mode():
        torch.testing.assert_close(layer(x[:4]).float(), F.linear(x[:4].float(), layer.weight.float(), layer.bias.float()),
                                   atol=0.1, rtol=1e-2)
    assert calls == [amx_linear.MAX_ROWS]


def test_no_tiles_for_other_dtypes_or_a_bias_of_another_dtype():
    assert amx_linear.pack(torch.randn(32, 32)) is None
    layer = nn.Linear(32, 32).bfloat16()
    layer.bias = nn.Parameter(layer.bias.float())
    assert pack_linears(layer) == 1 and layer._fast[6] is None
