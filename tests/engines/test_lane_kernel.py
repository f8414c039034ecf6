"""The decode-lane kernel (lane_attention.cpp) against torch's attention math, in both of its builds."""

from __future__ import annotations

import logging

import pytest
import torch
from mstar_attn_torch import lane_kernel
from mstar_attn_torch.backend import LanePlan, decode_attention

from mstar_core.nn import native

VARIANTS = [v for v in ("native", "avx2", "portable") if lane_kernel.kernel_for(torch.float32, v) is not None]
pytestmark = pytest.mark.skipif(not VARIANTS, reason="no C++ compiler: the kernel cannot be built here")


def _case(dtype, head_dim, group, gen, lanes=7, capacity=40):
    """Lanes of random keys, 5 rows decoding in shuffled lanes and rows, each with its own length."""
    kv_heads = 2
    store = torch.randn(lanes, 2, kv_heads, capacity, head_dim, generator=gen).to(dtype)  # head-major lanes
    store_k, store_v = store[:, 0].transpose(1, 2), store[:, 1].transpose(1, 2)  # [lanes, capacity, heads, dim] views
    tokens = 6
    q = torch.randn(tokens, kv_heads * group, head_dim, generator=gen).to(dtype)
    # v a strided view of a fused projection, k a fresh tensor (as rotary leaves them): different strides
    kv = torch.randn(tokens, 2, kv_heads, head_dim, generator=gen).to(dtype)
    rows = torch.tensor([4, 0, 2, 5, 1])
    lane_ids = torch.tensor([3, 6, 0, 1, 5])
    bound = torch.tensor([1, 17, 40, 33, 16])
    pos = bound - 1
    plan = LanePlan(rows, lane_ids, pos, 7, 40, None, False, None, bound)
    return store_k, store_v, q, kv[:, 0].contiguous(), kv[:, 1], plan


def _reference(store_k, store_v, q, k, v, plan, scale):
    """The lanes after the writes and each row's output, by torch ops in fp32."""
    store_k, store_v = store_k.clone(), store_v.clone()
    store_k[plan.lanes, plan.pos], store_v[plan.lanes, plan.pos] = k[plan.rows], v[plan.rows]
    outs = []
    for row, lane, n in zip(plan.rows.tolist(), plan.lanes.tolist(), plan.bound.tolist(), strict=True):
        keys = store_k[lane, :n].transpose(0, 1)[None].float()
        vals = store_v[lane, :n].transpose(0, 1)[None].float()
        outs.append(decode_attention(q[row][None].float(), keys, vals, None, scale)[0])
    return store_k, store_v, torch.stack(outs)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 1), (16, 2), (48, 4)])
def test_kernel_matches_torch_attention(variant, dtype, head_dim, group, monkeypatch):
    """Appends each row's key/value at its position and attends over [0, bound) of its lane, any row and lane order."""
    gen = torch.Generator().manual_seed(head_dim + group)
    store_k, store_v, q, k, v, plan = _case(dtype, head_dim, group, gen)
    want_k, want_v, want = _reference(store_k, store_v, q, k, v, plan, 0.17)
    monkeypatch.setenv(native.SWITCH_ENV, variant)
    call = lane_kernel.LaneCall.for_plan(plan, store_k)
    assert call is not None and call.fits(q, k, v, store_k)
    out = torch.full_like(q, 7.0)  # rows not decoding in a lane (3 here) stay untouched
    call(q, k, v, store_k, store_v, out, 0.17)
    assert torch.equal(store_k, want_k) and torch.equal(store_v, want_v)
    got = out[plan.rows].float()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    else:  # the fp32 result rounded once to bf16: within one bf16 step of the fp32 reference
        torch.testing.assert_close(got, want, atol=1e-2, rtol=8e-3)
    assert torch.equal(out[3], torch.full_like(out[3], 7.0))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_alone_split_by_query_head_gives_the_bits_it_gets_in_a_batch(variant, dtype, monkeypatch):
    """One decoding row's few KV groups run as a task a query head; a batch's rows as a task a group: same bits."""
    monkeypatch.setenv(native.SWITCH_ENV, variant)
    gen = torch.Generator().manual_seed(5)
    store_k, store_v, q, k, v, plan = _case(dtype, 64, 3, gen)
    batch_k, batch_v, batch_out = store_k.clone(), store_v.clone(), torch.zeros_like(q)
    lane_kernel.LaneCall.for_plan(plan, batch_k)(q, k, v, batch_k, batch_v, batch_out, 0.17)
    for i in range(len(plan.rows)):
        one = LanePlan(plan.rows[i:i + 1], plan.lanes[i:i + 1], plan.pos[i:i + 1], 7, 40, None, False, None,
                       plan.bound[i:i + 1])
        alone_k, alone_v, alone_out = store_k.clone(), store_v.clone(), torch.zeros_like(q)
        lane_kernel.LaneCall.for_plan(one, alone_k)(q, k, v, alone_k, alone_v, alone_out, 0.17)
        row = plan.rows[i]
        assert torch.equal(alone_out[row], batch_out[row])
        lane, at = plan.lanes[i], plan.pos[i]
        assert torch.equal(alone_k[lane, at], batch_k[lane, at]) and torch.equal(alone_v[lane, at], batch_v[lane, at])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_given_the_pool_stores_each_rows_key_and_value_in_its_slot(variant, dtype, monkeypatch):
    """With the paged pool passed, each packed row's new key and value land in its slot (others untouched), and
    the lanes and outputs are the same as without it."""
    gen = torch.Generator().manual_seed(3)
    store_k, store_v, q, k, v, plan = _case(dtype, 64, 3, gen)
    pool = torch.randn(2, 50, 2, 64, generator=gen).to(dtype)  # [k/v, slots, kv heads, head dim]
    slots = torch.tensor([11, 3, 42, 0, 27, 19])  # of each packed row (row 3 is not decoding in a lane)
    monkeypatch.setenv(native.SWITCH_ENV, variant)
    plain_k, plain_v, plain_out = store_k.clone(), store_v.clone(), torch.zeros_like(q)
    lane_kernel.LaneCall.for_plan(plan, store_k)(q, k, v, plain_k, plain_v, plain_out, 0.2)
    want = pool.clone()
    want[0, slots[plan.rows]], want[1, slots[plan.rows]] = k[plan.rows], v[plan.rows]
    out = torch.zeros_like(q)
    lane_kernel.LaneCall.for_plan(plan, store_k)(q, k, v, store_k, store_v, out, 0.2, (pool[0], pool[1], slots))
    assert torch.equal(pool, want)
    assert torch.equal(store_k, plain_k) and torch.equal(store_v, plain_v) and torch.equal(out, plain_out)


def test_builds_agree_with_each_other():
    """The AVX-512 and AVX2 kernels and the portable loops give the same answer (where this CPU runs them)."""
    if len(VARIANTS) < 2:
        pytest.skip("one build only here")
    results = []
    for variant in VARIANTS:
        store_k, store_v, q, k, v, plan = _case(torch.bfloat16, 64, 3, torch.Generator().manual_seed(5))
        out = torch.zeros_like(q)
        lane_kernel.LaneCall(lane_kernel.kernel_for(torch.bfloat16, variant), plan)(q, k, v, store_k, store_v, out, 0.125)
        results.append(out[plan.rows].float())
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], atol=1e-2, rtol=8e-3)


def test_tensors_the_kernel_cannot_read_go_through_torch_ops():
    """Mixed dtypes or a non-unit innermost stride: `fits` says no and the backend keeps its torch path."""
    store_k, store_v, q, k, v, plan = _case(torch.bfloat16, 64, 3, torch.Generator().manual_seed(1))
    call = lane_kernel.LaneCall.for_plan(plan, store_k)
    assert call.fits(q, k, v, store_k)
    assert not call.fits(q.float(), k, v, store_k)
    assert not call.fits(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, store_k)
    assert lane_kernel.LaneCall.for_plan(plan, store_k.half()) is None  # no fp16 kernel


def test_without_a_compiler_lanes_use_torch_ops(monkeypatch, tmp_path, caplog):
    """No compiler and no prebuilt library (the `jit` setting passes the prebuilt ones by): no kernel, one
    warning per build, and nothing is built. (With a prebuilt library and no compiler the kernel loads:
    tests/nn/test_native_prebuilt.py.)"""
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="mstar.nn.native"):
        assert lane_kernel.kernel_for(torch.bfloat16, "jit") is None
        assert lane_kernel.kernel_for(torch.float32, "jit") is None
    assert sum("no C++ compiler" in r.message for r in caplog.records) == 1
    assert not (tmp_path / "cache").exists()


def test_switch_turns_the_kernel_off_and_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv(native.SWITCH_ENV, "0")
    assert lane_kernel.kernel_for(torch.bfloat16) is None
    monkeypatch.setenv(native.SWITCH_ENV, "fast")
    with pytest.raises(ValueError, match="MSTAR_NATIVE_KERNELS"):
        lane_kernel.kernel_for(torch.bfloat16)
