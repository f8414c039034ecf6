"""A decode step's lane attention naming the next layer's lanes for the panel linears to fetch (mstar::SideFetch).

The fetches are hints: every output must have the bits it has without them, and the record must name only the next
layer's lanes (none after the last layer, whose next one does not exist).
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from mstar_attn_torch import lane_kernel
from mstar_attn_torch.backend import LanePlan

from mstar_core.nn import bf16_linear, fp32_linear

# each lane dtype with the panel kernel its model's linears run on, where both are built here
LINEARS = {torch.float32: fp32_linear, torch.bfloat16: bf16_linear}
DTYPES = [d for d, kernel in LINEARS.items() if lane_kernel.kernel_for(d) is not None and kernel.available()
          and lane_kernel.side_fetch_record(d) is not None]
pytestmark = pytest.mark.skipif(not DTYPES, reason="no C++ compiler (or no AVX2/FMA): the kernels cannot be built here")

LAYERS, LANES, KV_HEADS, GROUP, CAPACITY, DIM = 3, 6, 3, 3, 48, 64


def _spans(dtype) -> int:
    """Spans the record of `dtype`'s linears names now (its first field)."""
    return ctypes.c_int64.from_address(lane_kernel.side_fetch_record(dtype)).value


def _step(gen, dtype):
    """Lanes of every layer (head-major, as DecodeLanes keeps them), a step's q/k/v and a plan of 5 rows."""
    kv = torch.randn(LAYERS, 2, LANES, KV_HEADS, CAPACITY, DIM, generator=gen).to(dtype).transpose(3, 4)
    q = torch.randn(5, KV_HEADS * GROUP, DIM, generator=gen).to(dtype)
    k = torch.randn(5, KV_HEADS, DIM, generator=gen).to(dtype)
    v = torch.randn(5, KV_HEADS, DIM, generator=gen).to(dtype)
    bound = torch.tensor([7, 48, 30, 1, 19])
    plan = LanePlan(torch.tensor([2, 0, 4, 1, 3]), torch.tensor([5, 1, 0, 3, 2]), bound - 1, LANES, 48, None, False,
                    None, bound)
    return kv, q, k, v, plan


def _attend_every_layer(kv, q, k, v, plan, side_rows, monkeypatch):
    """Each layer's call in order, the linears' record set as `side_rows` allows; the outputs and spans named after each."""
    monkeypatch.setattr(lane_kernel, "SIDE_FETCH_ROWS", side_rows)
    monkeypatch.setattr(lane_kernel, "SIDE_FETCH_DTYPES", (q.dtype,))  # (the kernels of every dtype walk it)
    call = lane_kernel.LaneCall.for_plan(plan, kv[:, 0])
    outs, spans = [], []
    for layer in range(LAYERS):
        out = torch.zeros_like(q)
        call(q, k, v, kv[layer, 0], kv[layer, 1], out, 0.125)
        outs.append(out)
        spans.append(_spans(q.dtype))
    return outs, spans


@pytest.mark.parametrize("dtype", DTYPES)
def test_lane_attention_names_the_next_layer_and_computes_the_same_bits(dtype, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    kv, q, k, v, plan = _step(gen, dtype)
    kv_off = kv.clone()
    want, _ = _attend_every_layer(kv_off, q, k, v, plan, 1 << 20, monkeypatch)  # (too few rows: no record)
    got, spans = _attend_every_layer(kv, q, k, v, plan, 1, monkeypatch)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(kv, kv_off)  # (the new keys and values stored alike)
    # every row's keys and values in every KV head of the next layer, none after the last layer
    assert spans == [2 * 5 * KV_HEADS, 2 * 5 * KV_HEADS, 0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_panel_linear_fetching_named_lines_keeps_its_bits(dtype, monkeypatch):
    """A linear that walks the record's spans as it computes gives the bits it gives with none named."""
    gen = torch.Generator().manual_seed(4)
    kernel = LINEARS[dtype]
    packed = kernel.pack((torch.randn(200, 576, generator=gen) * 0.05).to(dtype))
    rows = torch.randn(32, 576, generator=gen).to(dtype)
    kv, q, k, v, plan = _step(gen, dtype)
    _attend_every_layer(kv, q, k, v, plan, 1 << 20, monkeypatch)
    assert _spans(dtype) == 0
    want = kernel.linear(rows, packed, 200, None)
    monkeypatch.setattr(lane_kernel, "SIDE_FETCH_ROWS", 1)
    call = lane_kernel.LaneCall.for_plan(plan, kv[:, 0])
    call(q, k, v, kv[0, 0], kv[0, 1], torch.zeros_like(q), 0.125)  # (layer 0: names layer 1's lanes)
    assert _spans(dtype) > 0
    for _ in range(3):  # (walking the spans, then past their end)
        assert torch.equal(kernel.linear(rows, packed, 200, None), want)
