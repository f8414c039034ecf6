"""Wire codec: every message type and dtype round-trips exactly; zero copy where promised."""

from __future__ import annotations

import pytest
import torch

from mstar_core.wire import (
    MESSAGES,
    ErrorReport,
    Heartbeat,
    Hello,
    InvokeNode,
    LoadModel,
    LoopDone,
    LoopValues,
    ModelLoaded,
    NodeResult,
    Release,
    RunLoop,
    Shutdown,
    Welcome,
    decode,
    encode,
)
from mstar_core.wire.messages import RunConsumer, StreamEnd, StreamItem
from mstar_core.wire.tensors import DTYPES


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe, works for every dtype) plus dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def roundtrip(msg):
    frames = encode(msg)
    assert isinstance(frames[0], bytes)
    # What a socket delivers: independent bytes objects.
    return decode([bytes(f) for f in frames])


SAMPLES = [
    Hello(worker="w0", pid=12, host="h", protocol=1, nonce="ab", timestamp=1.5, mac="ff"),
    Welcome(worker="w0", session="s", heartbeat_interval=0.5, nonce="ab", mac="00"),
    Heartbeat(worker="w0", seq=7, time=3.25, load={"active": 3, "kv_free": 0.5}),
    LoadModel(model="orpheus", device="cpu", nodes=["lm", "codec"], preset="tiny", settings={"lm": {"num_pages": 8}}),
    ModelLoaded(worker="w0", model="orpheus", nodes=["lm"]),
    InvokeNode(request_id="r1", node="lm", call_index=2, options={"temperature": 0.7},
               inputs={"ids": torch.arange(5), "meta": {"voice": "tara", "n": [1, 2.5, None, True]}}),
    NodeResult(request_id="r1", node="lm", call_index=2, outputs={"logits": torch.randn(2, 3)}),
    NodeResult(request_id="r1", node="lm", call_index=2, error="boom", error_type="ValueError"),
    Release(request_id="r1"),
    Shutdown(reason="bye"),
    Shutdown(),
    ErrorReport(worker="w0", message="oom", error_type="RuntimeError", request_id="r2"),
    RunLoop(request_id="r3", model="orpheus", walk="decode", loop=0, env={"ids": torch.arange(3), "n": 4}),
    LoopValues(request_id="r3", loop=0, call=1, outputs={"next_token": 17, "finish_reason": None}),
    LoopDone(request_id="r3", loop=0, env={"next_token": 9, "finish_reason": "stop"}),
    LoopDone(request_id="r3", loop=0, error="boom", error_type="ValueError", node="lm"),
    RunLoop(request_id="r3", model="orpheus", walk="decode", loop=0, env={},
            streams={"0": {"to": "tcp://127.0.0.1:5", "nonce": "ab", "session": "00" * 8, "start": 3}}),
    LoopDone(request_id="r3", loop=0, env={}, streamed={"0": 12}),
    RunConsumer(request_id="r3", model="orpheus", walk="decode", stream=0, env={"n": 4}, nonce="ab",
                session="00" * 8, branch="1"),
    StreamItem(request_id="r3", stream=0, value={"token": 5, "hidden": torch.randn(4)}),
    StreamEnd(request_id="r3", stream=0, items=12),
]


def test_samples_cover_every_message_type():
    assert {type(m) for m in SAMPLES} == set(MESSAGES.values())


def _eq(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and same(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_eq(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, list) and len(a) == len(b) and all(_eq(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_roundtrips(msg):
    out = roundtrip(msg)
    assert type(out) is type(msg)
    for spec in type(msg).__wire_fields__:
        assert _eq(getattr(msg, spec.name), getattr(out, spec.name)), spec.name


def _make(dtype: torch.dtype, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (max(1, int(torch.tensor(shape).prod())) * 16,), dtype=torch.uint8, generator=g)
    size = torch.empty((), dtype=dtype).element_size()
    n = int(torch.tensor(shape).prod()) if shape else 1
    t = raw[: n * size].view(dtype).reshape(shape)
    return t.clone() if dtype != torch.bool else (t.view(torch.uint8) % 2).view(torch.bool)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (2, 0, 3), (7,), (3, 5)], ids=str)
def test_every_dtype_and_shape_roundtrips_bitwise(dtype, shape):
    t = _make(dtype, shape)
    out = roundtrip(InvokeNode(request_id="r", node="n", call_index=0, inputs={"t": t})).inputs["t"]
    assert same(t, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.complex64, torch.float8_e4m3fn])
def test_non_contiguous_views_keep_values_and_strides(dtype):
    base = _make(dtype, (6, 8))
    views = {
        "transpose": base.t(),
        "slice_step": base[:, ::2],
        "offset_slice": base[2:, 3:],
        "expand": _make(dtype, (1, 8)).expand(5, 8),
    }
    for name, v in views.items():
        out = roundtrip(InvokeNode(request_id="r", node="n", call_index=0, inputs={"v": v})).inputs["v"]
        assert same(v, out), name
        if name in ("transpose", "expand"):
            assert out.stride() == v.stride(), name  # sent as its storage span, no compaction copy


def test_contiguous_tensor_is_sent_and_received_without_copy():
    t = torch.randn(1024, 64)
    frames = encode(InvokeNode(request_id="r", node="n", call_index=0, inputs={"t": t}))
    frame = frames[1]
    assert isinstance(frame, memoryview)
    assert torch.frombuffer(frame, dtype=torch.uint8).data_ptr() == t.data_ptr()  # encode aliases the tensor
    buf = bytearray(frame)
    out = decode([frames[0], buf]).inputs["t"]
    assert out.data_ptr() == torch.frombuffer(buf, dtype=torch.uint8).data_ptr()  # decode aliases the frame
    assert torch.equal(out, t)


def test_tiny_slice_of_huge_storage_is_compacted():
    big = torch.zeros(1000, 1000)
    v = big[::500, ::500]  # 4 elements spread over ~500k
    frames = encode(InvokeNode(request_id="r", node="n", call_index=0, inputs={"v": v}))
    assert memoryview(frames[1]).nbytes == 4 * 4
    assert same(decode(frames).inputs["v"], v)


def test_grad_and_conj_tensors_are_sent_by_value():
    a = torch.randn(3, requires_grad=True)
    c = torch.randn(3, dtype=torch.complex64).conj()
    out = roundtrip(InvokeNode(request_id="r", node="n", call_index=0, inputs={"a": a, "c": c})).inputs
    assert same(out["a"], a.detach()) and same(out["c"], c.resolve_conj())


def test_keep_device_leaves_cpu_tensors_as_buffers():
    frames = encode(InvokeNode(request_id="r", node="n", call_index=0, inputs={"t": torch.ones(3)}), keep_device=True)
    assert isinstance(frames[1], memoryview)


def test_dollar_keys_and_marker_lookalikes_survive():
    inputs = {"$t": 0, "$$x": {"$f": "nan"}, "plain": [{"$t": 5}], "t": torch.ones(2)}
    out = roundtrip(InvokeNode(request_id="r", node="n", call_index=0, inputs=inputs)).inputs
    assert _eq(inputs, out)


def test_non_finite_floats_roundtrip():
    inputs = {"a": float("inf"), "b": float("-inf"), "c": float("nan"), "d": -0.0}
    out = roundtrip(InvokeNode(request_id="r", node="n", call_index=0, inputs=inputs)).inputs
    assert out["a"] == float("inf") and out["b"] == float("-inf") and out["c"] != out["c"]
    assert str(out["d"]) == "-0.0"


def test_tuples_travel_as_lists():
    out = roundtrip(InvokeNode(request_id="r", node="n", call_index=0, inputs={"t": (1, (2, 3))})).inputs
    assert out == {"t": [1, [2, 3]]}


def test_float_fields_accept_ints_and_decode_as_float():
    out = roundtrip(Heartbeat(worker="w", seq=1, time=3))
    assert out.time == 3.0 and type(out.time) is float
