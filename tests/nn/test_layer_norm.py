"""The decode rows' LayerNorm kernel (`mstar_core.nn.layer_norm`, `layer_norm.cpp`) against torch's op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.nn import native_build
from mstar_core.nn.layer_norm import layer_norm, layer_norm_rows

pytestmark = pytest.mark.skipif(layer_norm(torch.zeros(1, 4), torch.ones(4), torch.zeros(4), 1e-5) is None,
                                reason="the kernel is not built here (no compiler)")


@pytest.mark.parametrize("variant", [None, "avx2", "portable"])
@pytest.mark.parametrize("dim", [512, 384, 37])  # (37: the scalar tail alone past two vectors)
def test_rows_match_torch_within_an_ulp_of_the_statistics(variant, dim):
    if variant is not None and variant not in native_build.BY_NAME:
        pytest.skip(f"no {variant} level on this architecture")
    g = torch.Generator().manual_seed(dim)
    w, b = torch.randn(dim, generator=g), torch.randn(dim, generator=g)
    same = total = 0
    for scale in (0.05, 1.0, 40.0):  # (an offset per row as large as its spread: the mean matters)
        x = (torch.randn(64, dim, generator=g) + torch.randn(64, 1, generator=g)) * scale
        got, want = layer_norm(x, w, b, 1e-5, variant), F.layer_norm(x, (dim,), w, b, 1e-5)
        # torch's float moments are off the correctly rounded ones by an ulp on some rows: the outputs by as much
        torch.testing.assert_close(got, want, atol=4e-6, rtol=4e-6)
        same, total = same + int((got == want).sum()), total + got.numel()
    assert same > total // 2  # (most rows' statistics agree to the bit, and then every output bit does)


def test_a_row_is_the_same_alone_or_batched_and_strided_rows_are_read_in_place():
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(300, 3 * 64, generator=g)  # (rows of a fused projection's output: a row stride of 192)
    x, w, b = wide[:, 64:128], torch.randn(64, generator=g), torch.randn(64, generator=g)
    together = layer_norm(x, w, b, 1e-5)  # (300 rows: split across the threads)
    for i in (0, 7, 299):
        assert torch.equal(layer_norm(x[i : i + 1], w, b, 1e-5), together[i : i + 1])


def test_what_the_kernel_does_not_take_runs_torchs_op():
    norm = nn.LayerNorm(8)
    x = torch.randn(3, 8)
    assert layer_norm(x[:2].double(), norm.weight.double(), norm.bias.double(), 1e-5) is None
    assert layer_norm(x.view(3, 2, 4), norm.weight, norm.bias, 1e-5) is None  # (2-D rows only)
    assert layer_norm(x[:2], norm.weight, norm.bias, 1e-5) is None  # (autograd records the weight: torch's op)
    assert torch.equal(layer_norm_rows(norm, x), norm(x))
    with torch.inference_mode():
        assert layer_norm(x[:2], norm.weight, norm.bias, norm.eps) is not None
        assert layer_norm(x[:2], norm.weight, None, norm.eps) is None
