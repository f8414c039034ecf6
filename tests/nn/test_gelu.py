"""The decode-step GELU kernel (`mstar_core.nn.gelu`, `gelu.cpp`): torch's exact GELU within fp32 rounding of its erf,
in place, for each build level; bigger tensors, autograd and other dtypes are left to torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mstar_core.nn import gelu, native_build

pytestmark = pytest.mark.skipif(gelu._function(None) is None, reason="the kernel is not built here (no compiler)")


@pytest.mark.parametrize("variant", [None, "avx2", "portable"])
def test_matches_torch_exact_gelu_in_place(variant):
    if variant is not None and variant not in native_build.BY_NAME:
        pytest.skip(f"no {variant} level on this architecture")
    # the whole range (saturated tails, the cancellation below zero, near zero) and a 2048-wide row's odd tail
    x = torch.cat([torch.linspace(-12, 12, 20001), torch.randn(4575, generator=torch.Generator().manual_seed(0)) * 4])
    x = x.reshape(12, 2048)
    want = F.gelu(x)
    y = x.clone()
    assert gelu.gelu_(y, variant) is y
    torch.testing.assert_close(y, want, atol=2e-6, rtol=2e-6)
    odd = x.flatten()[:2047].clone()  # (a length off the 16-lane blocks)
    gelu.gelu_(odd, variant)
    torch.testing.assert_close(odd, F.gelu(x.flatten()[:2047]), atol=2e-6, rtol=2e-6)


def test_leaves_what_it_does_not_take_to_torch():
    assert gelu.gelu_(torch.randn(gelu.MAX_ROWS + 1, 64)) is None  # (an encoder's rows: torch's op is as fast)
    assert gelu.gelu_(torch.randn(4, 64, dtype=torch.bfloat16)) is None
    assert gelu.gelu_(torch.randn(4, 64).t()) is None  # not contiguous
    x = torch.randn(2, 64, requires_grad=True)
    assert gelu.gelu_(x) is None
