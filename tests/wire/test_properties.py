"""Property tests: arbitrary nested values (with tensors) survive encode/decode exactly."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_core.wire import InvokeNode, NodeResult, decode, encode

_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.float16, torch.int8]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    n = math.prod(shape)
    size = torch.empty((), dtype=dtype).element_size()
    raw = draw(st.binary(min_size=n * size, max_size=n * size))
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    t = t.view(dtype) if dtype != torch.bool else (t % 2).view(torch.bool)
    t = t.reshape(shape)
    if t.dim() == 2 and draw(st.booleans()):
        t = t.t()  # non-contiguous
    return t


scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
values = st.recursive(
    scalars | tensors(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


def _eq(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_eq(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_eq(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return isinstance(b, float) and (math.isnan(a) and math.isnan(b) or (a == b and str(a) == str(b)))
    return type(a) is type(b) and a == b


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text(max_size=6), values, max_size=5), st.dictionaries(st.text(max_size=4), scalars))
def test_nested_values_roundtrip(inputs, options):
    msg = InvokeNode(request_id="r", node="n", call_index=1, inputs=inputs, options=options)
    out = decode([bytes(f) for f in encode(msg)])
    assert _eq(inputs, out.inputs) and _eq(options, out.options)


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(st.text(max_size=6), values, max_size=4))
def test_node_result_outputs_roundtrip(outputs):
    out = decode(encode(NodeResult(request_id="r", node="n", call_index=0, outputs=outputs)))
    assert _eq(outputs, out.outputs)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=3))
def test_garbage_frames_only_ever_raise_wire_error(frames):
    from mstar_core.wire import WireError

    try:
        decode(frames)
    except WireError:
        pass
