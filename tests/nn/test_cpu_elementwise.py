"""The fused CPU RMSNorm and SiLU-and-multiply (cpu_elementwise.cpp) against the torch ops they replace."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from mstar_core.nn import cpu_elementwise, native
from mstar_core.nn.mlp import GatedMLP
from mstar_core.nn.norm import RMSNorm
from mstar_core.nn.rotary import RotaryEmbedding, apply_rotary, apply_rotary_

VARIANTS = [v for v in ("native", "avx2", "portable") if native.load(cpu_elementwise.SOURCE, v) is not None]
pytestmark = pytest.mark.skipif(not VARIANTS, reason="no C++ compiler: the kernels cannot be built here")


def _torch_rms_norm(x, weight, eps):
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,dim", [(1, 64), (7, 576), (300, 96), (130, 33)])
def test_rms_norm_rounds_as_the_torch_ops(variant, dtype, rows, dim):
    gen = torch.Generator().manual_seed(rows * dim)
    x = (torch.randn(rows, dim + 5, generator=gen) * 3).to(dtype)[:, 2 : dim + 2]  # a strided row view
    weight = (torch.randn(dim, generator=gen) * 0.3 + 1).to(dtype)
    got = cpu_elementwise.rms_norm(x, weight, 1e-5, variant)
    want = _torch_rms_norm(x, weight, 1e-5)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.bfloat16:  # the same roundings: equal, except where the fp32 sum order moves a tie (rare)
        assert (got != want).float().mean() <= 0.002
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=8e-3)
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_per_head_norm_over_a_fused_qkv_view_is_each_head_normed_alone(variant, dtype, rows):
    """q of a fused [T, q + k + v] output viewed as [T, heads, D]: no 2-D stride covers it, yet no copy is made."""
    gen = torch.Generator().manual_seed(rows)
    qkv = (torch.randn(rows, 8 * 64 + 2 * 2 * 64, generator=gen) * 3).to(dtype)
    q = qkv[:, : 8 * 64].view(rows, 8, 64)
    weight = (torch.randn(64, generator=gen) * 0.3 + 1).to(dtype)
    got = cpu_elementwise.rms_norm(q, weight, 1e-6, variant)
    want = torch.stack([cpu_elementwise.rms_norm(q[:, h].contiguous(), weight, 1e-6, variant) for h in range(8)], 1)
    assert got.shape == (rows, 8, 64) and torch.equal(got, want)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,dim", [(1, 64), (300, 576)])
def test_residual_add_is_torch_s_add(variant, dtype, rows, dim):
    gen = torch.Generator().manual_seed(rows + dim)
    acc = (torch.randn(rows, dim, generator=gen) * 3).to(dtype)
    other = (torch.randn(rows, dim + 4, generator=gen) * 5).to(dtype)[:, :dim]  # a strided residual
    want = other + acc
    assert cpu_elementwise.add_(acc, other, variant)
    assert torch.equal(acc, want)
    assert not cpu_elementwise.add_(acc.t(), other.t(), variant)  # (not contiguous rows: the caller adds)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,dim", [(1, 64), (7, 576), (300, 96)])
def test_add_rms_norm_writes_the_rounded_sum_and_norms_it(variant, dtype, rows, dim):
    """The residual sum bitwise torch's add (written over delta), its norm as `rms_norm` of that sum."""
    gen = torch.Generator().manual_seed(rows + dim)
    delta = (torch.randn(rows, dim, generator=gen) * 3).to(dtype)
    residual = (torch.randn(rows, dim + 4, generator=gen) * 5).to(dtype)[:, :dim]  # a strided residual
    weight = (torch.randn(dim, generator=gen) * 0.3 + 1).to(dtype)
    want_sum = residual + delta
    normed = cpu_elementwise.add_rms_norm_(delta, residual, weight, 1e-5, variant)
    assert torch.equal(delta, want_sum)
    assert torch.equal(normed, cpu_elementwise.rms_norm(want_sum, weight, 1e-5, variant))
    norm = RMSNorm(dim).to(dtype)
    total, _ = norm.add_forward(delta, residual)  # a weight under autograd: torch ops, a new sum
    assert total is not delta and torch.equal(total, residual + delta)
    with torch.no_grad():
        total, got = norm.add_forward(delta, residual)
        assert total is delta and torch.equal(got, norm(total))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 1536), (9, 40), (64, 100)])
def test_silu_mul_rounds_as_the_torch_ops(variant, dtype, rows, width):
    gen = torch.Generator().manual_seed(rows + width)
    gate_up = (torch.randn(rows, 2 * width, generator=gen) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([200.0, -200.0, float("nan"), 0.0])
    got = cpu_elementwise.silu_mul(gate_up, width, variant)
    if got is None:  # a build without AVX2 or AVX-512 leaves SiLU to torch (its exp is scalar there)
        assert not native.function(cpu_elementwise.SOURCE, "mstar_elementwise_vectorized", [], ctypes.c_int, variant)()
        return
    want = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    assert got[0, 2].isnan() and got[0, 1] == 0 and got[0, 3] == 0
    if dtype == torch.bfloat16:
        same = (got == want) | (got.isnan() & want.isnan())
        assert (~same).float().mean() <= 0.002
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=8e-3, equal_nan=True)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6, equal_nan=True)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,heads,dim,rot", [(1, 12, 64, 64), (33, 5, 128, 64), (300, 4, 96, 96), (7, 3, 64, 40)])
def test_rotary_in_place_rounds_as_the_torch_ops(variant, dtype, rows, heads, dim, rot):
    """Bitwise apply_rotary's result (products and sum each rounded), into strided heads, partial rotary passing the rest."""
    gen = torch.Generator().manual_seed(rows * heads)
    base = (torch.randn(rows, heads + 2, dim + 3, generator=gen) * 3).to(dtype)
    x = base[:, 1 : heads + 1, 1 : dim + 1]  # strided rows and heads, as q and k sit in a fused projection
    cos, sin = RotaryEmbedding(rot, {"rope_type": "default", "rope_theta": 10000.0})(torch.randint(0, 5000, (rows,), generator=gen))
    want = apply_rotary(x, cos, sin)
    outside = base.clone()
    assert cpu_elementwise.rotary_(x, cos, sin, variant)
    assert torch.equal(x, want)
    x.copy_(outside[:, 1 : heads + 1, 1 : dim + 1])
    assert torch.equal(base, outside)  # nothing outside the view was written


def test_rotary_in_place_only_where_it_applies():
    """Grad, fp16 or bf16 tables, a table of another length: apply_rotary_ returns apply_rotary's new tensor."""
    cos, sin = RotaryEmbedding(16)(torch.arange(3))
    x = torch.randn(3, 2, 16, requires_grad=True)
    out = apply_rotary_(x, cos, sin)
    assert out is not x and out.requires_grad
    with torch.no_grad():
        for args in ((x.detach().half(), cos, sin), (x.detach(), cos.bfloat16(), sin.bfloat16()), (x.detach()[:2], cos, sin)):
            assert not cpu_elementwise.rotary_(*args)
        y = x.detach().clone()
        assert apply_rotary_(y, cos, sin) is y and torch.equal(y, apply_rotary(x.detach(), cos, sin))


def test_modules_take_the_kernels_only_where_they_apply():
    """No kernel under autograd, for mixed dtypes or off CPU: those run the torch ops (and gradients flow)."""
    norm, mlp = RMSNorm(32), GatedMLP(32, 48)
    x = torch.randn(4, 32, requires_grad=True)
    (norm(x).sum() + mlp(x).sum()).backward()  # the kernels have no backward: autograd must not reach them
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert cpu_elementwise.rms_norm(x.detach().bfloat16(), norm.weight.detach(), 1e-6) is None  # bf16 rows, fp32 weight
    with torch.no_grad():
        assert cpu_elementwise.rms_norm(x, norm.weight, 1e-6) is not None
        torch.testing.assert_close(norm(x), _torch_rms_norm(x, norm.weight, 1e-6), atol=1e-6, rtol=1e-6)
