"""Malformed input raises WireError with a message naming the problem; nothing is executed."""

from __future__ import annotations

import pathlib

import orjson
import pytest
import torch

from mstar_core.wire import InvokeNode, NodeResult, Release, WireError, decode, encode


def _good():
    return encode(InvokeNode(request_id="r", node="n", call_index=0, inputs={"t": torch.arange(4)}))


def _with(top_edit, frames=None):
    frames = list(frames or _good())
    top = orjson.loads(frames[0])
    top_edit(top)
    frames[0] = orjson.dumps(top)
    return frames


@pytest.mark.parametrize(
    ("frames", "needle"),
    [
        ([b"not json"], "not valid JSON"),
        ([b"[1, 2]"], "must be an object"),
        ([orjson.dumps({"type": "release"})], "must be an object with keys"),
        ([orjson.dumps({"type": "exec", "fields": {}, "tensors": []})], "unknown message type 'exec'"),
        ([orjson.dumps({"type": 5, "fields": {}, "tensors": []})], "unknown message type 5"),
        ([orjson.dumps({"type": "release", "fields": [], "tensors": []})], "'fields' must be an object"),
        ([orjson.dumps({"type": "release", "fields": {}, "tensors": []})], "missing field 'request_id'"),
        ([orjson.dumps({"type": "release", "fields": {"request_id": 3}, "tensors": []})],
         "field 'request_id' must be a str"),
        ([orjson.dumps({"type": "release", "fields": {"request_id": "r", "cmd": "rm"}, "tensors": []})],
         "unknown field(s): cmd"),
        ([orjson.dumps({"type": "heartbeat", "fields": {"worker": "w", "seq": True, "time": 1.0},
                        "tensors": []})], "field 'seq' must be an int"),
        ([orjson.dumps({"type": "node_result", "fields": {"request_id": "r", "node": "n", "call_index": 0},
                        "tensors": []})], "exactly one of `outputs` or `error`"),
    ],
)
def test_bad_header_frames(frames, needle):
    with pytest.raises(WireError, match=None) as e:
        decode(frames)
    assert needle in str(e.value)


def test_bad_tensor_parts():
    cases = [
        (_with(lambda t: t["tensors"][0].update(dtype="object")), "unknown tensor dtype 'object'"),
        (_with(lambda t: t["tensors"][0].update(nbytes=8)), "does not match shape"),
        (_with(lambda t: t["tensors"][0].update(shape=[-4])), "non-negative ints"),
        (_with(lambda t: t["tensors"][0].update(strides=[1, 1])), "1 dims but 2 strides"),
        (_with(lambda t: t["tensors"][0].pop("device")), "tensor header must have keys"),
        (_with(lambda t: t["fields"]["inputs"].update(t={"$t": 3})), "tensor reference 3 out of range"),
        (_with(lambda t: t["fields"]["inputs"].update(t={"$f": "huge"})), "bad non-finite float marker"),
        (_with(lambda t: t["fields"]["inputs"].update(t={"$x": 1})), "unknown marker key '$x'"),
        (_with(lambda t: t["tensors"].append(t["tensors"][0])), "declares 2 tensors but carries 1"),
        (_good()[:1], "declares 1 tensors but carries 0"),
        ([_good()[0], b"short"], "frame has 5 bytes, header says 32"),
        ([_good()[0], 12345], "bytes-like"),
    ]
    for frames, needle in cases:
        with pytest.raises(WireError) as e:
            decode(frames)
        assert needle in str(e.value), (needle, str(e.value))


def test_decode_rejects_non_frame_lists():
    for bad in ([], b"{}", None):
        with pytest.raises(WireError):
            decode(bad)


@pytest.mark.parametrize(
    ("inputs", "needle"),
    [
        ({"x": object()}, "cannot send a object"),
        ({1: "a"}, "dict keys must be str"),
        ({"x": 2**70}, "does not fit in 64 bits"),
        ({"x": "\ud800"}, "cannot be encoded as JSON"),
        ({"x": torch.ones(2).to_sparse()}, "only dense strided tensors"),
    ],
)
def test_encode_errors_name_the_field(inputs, needle):
    with pytest.raises(WireError) as e:
        encode(InvokeNode(request_id="r", node="n", call_index=0, inputs=inputs))
    assert needle in str(e.value)


def test_encode_checks_field_types_and_message_classes():
    with pytest.raises(WireError, match="field 'request_id' must be a str"):
        encode(Release(request_id=5))
    with pytest.raises(WireError, match="not a wire message"):
        encode({"type": "release"})
    with pytest.raises(WireError, match="needs its `error_type`"):
        NodeResult(request_id="r", node="n", call_index=0, error="x")


def test_deep_nesting_is_refused():
    v = []
    for _ in range(100):
        v = [v]
    with pytest.raises(WireError, match="nesting deeper"):
        encode(InvokeNode(request_id="r", node="n", call_index=0, inputs={"v": v}))


def test_no_pickle_in_wire_or_transports():
    root = pathlib.Path(__file__).resolve().parents[2]
    paths = list((root / "mstar_core" / "wire").rglob("*.py"))
    for name in ("zmq", "shm", "nccl"):
        paths += list((root / "plugins" / f"mstar-transport-{name}").rglob("*.py"))
    assert len(paths) > 10
    for p in paths:
        text = p.read_text()
        for bad in ("import pickle", "from pickle", "torch.load(", "recv_pyobj", "send_pyobj", "marshal"):
            assert bad not in text, f"{p} uses {bad}"
