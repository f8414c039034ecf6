"""ZeroMQ transport: TCP and IPC, zero-copy receive, async API, CURVE refusal, loopback-only default."""

from __future__ import annotations

import asyncio

import pytest
import torch
from mstar_transport_zmq import ZmqTransport
from mstar_transport_zmq.transport import ipc_address

from mstar_core.plugins import discover
from mstar_core.wire import InvokeNode, NodeResult, Release, TransportError

SECRET = b"a shared secret of some length"


def _pair(address: str, secret: bytes | None = None):
    a = ZmqTransport(secret=secret)
    addr = a.bind(address)
    b = ZmqTransport(secret=secret)
    b.connect(addr)
    return a, b


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:0", "ipc://"])
def test_roundtrip_big_tensor_zero_copy_receive(address):
    a, b = _pair(ipc_address() if address == "ipc://" else address)
    with a, b:
        b.send_msg(Release(request_id="hello"))
        assert a.recv_msg(5) == Release(request_id="hello")
        x = torch.randn(512, 1024)
        a.send_msg(InvokeNode(request_id="r", node="n", call_index=0, inputs={"x": x, "k": 3}))
        frames = b.recv(5)
        assert isinstance(frames[1], memoryview)  # zmq frame buffer, no copy into bytes
        from mstar_core.wire import decode

        m = decode(frames)
        assert torch.equal(m.inputs["x"], x) and m.inputs["k"] == 3


def test_async_send_and_recv():
    async def main():
        a, b = _pair("tcp://127.0.0.1:0")
        with a, b:
            await b.asend_msg(Release(request_id="hi"))
            assert await a.arecv_msg(5) == Release(request_id="hi")
            await a.asend_msg(InvokeNode(request_id="r", node="n", call_index=1, inputs={"x": torch.ones(3)}))
            m = await b.arecv_msg(5)
            assert torch.equal(m.inputs["x"], torch.ones(3))
            with pytest.raises(TimeoutError):
                await b.arecv(0.05)

    asyncio.run(main())


def test_curve_admits_the_secret_and_refuses_peers_without_it():
    a, b = _pair("tcp://127.0.0.1:0", SECRET)
    addr = a._sock.getsockopt_string(__import__("zmq").LAST_ENDPOINT)
    wrong = ZmqTransport(secret=b"some other secret value")
    wrong.connect(addr)
    plain = ZmqTransport()
    plain.connect(addr)
    with a, b, wrong, plain:
        wrong.send_msg(Release(request_id="wrong"))
        plain.send_msg(Release(request_id="plain"))
        b.send_msg(Release(request_id="ok"))
        assert a.recv_msg(5) == Release(request_id="ok")
        with pytest.raises(TimeoutError):
            a.recv(0.5)  # neither intruder got through the CURVE handshake
        a.send_msg(Release(request_id="back"))
        assert b.recv_msg(5) == Release(request_id="back")
        with pytest.raises(TimeoutError):
            wrong.recv(0.2)


def test_bound_side_talks_to_its_first_peer_only():
    a, b = _pair("tcp://127.0.0.1:0")
    other = ZmqTransport()
    other.connect(a._sock.getsockopt_string(__import__("zmq").LAST_ENDPOINT))
    with a, b, other:
        b.send_msg(Release(request_id="first"))
        assert a.recv_msg(5).request_id == "first"
        other.send_msg(Release(request_id="second"))
        with pytest.raises(TimeoutError):
            a.recv(0.3)
        a.unpin()
        other.send_msg(Release(request_id="again"))
        assert a.recv_msg(5).request_id == "again"


def test_bind_policy():
    with pytest.raises(TransportError, match="not a loopback address"):
        ZmqTransport().bind("tcp://0.0.0.0:0")
    with pytest.raises(TransportError, match="requires a shared secret"):
        ZmqTransport(allow_remote=True).bind("tcp://0.0.0.0:0")
    with pytest.raises(TransportError, match="needs a scheme"):
        ZmqTransport().bind("127.0.0.1:5555")
    t = ZmqTransport(allow_remote=True, secret=SECRET)
    with t:
        assert t.bind("tcp://0.0.0.0:0").startswith("tcp://0.0.0.0:")


def test_bound_side_cannot_speak_first():
    a = ZmqTransport()
    a.bind("tcp://127.0.0.1:0")
    with a, pytest.raises(TransportError, match="connecting side must send first"):
        a.send([b"x"])


def test_two_processes_echo(spawn):
    a = ZmqTransport(secret=SECRET)
    addr = a.bind("tcp://127.0.0.1:0")
    p = spawn("echo", "zmq", addr, SECRET.decode())
    with a:
        assert a.recv_msg(30) == Release(request_id="hello")
        x = torch.randn(1 << 18)
        a.send_msg(InvokeNode(request_id="r", node="n", call_index=4, inputs={"x": x, "s": "hi"}))
        out = a.recv_msg(30)
        assert isinstance(out, NodeResult) and torch.equal(out.outputs["x"], x * 2) and out.outputs["s"] == "hi"
        a.send_msg(Release(request_id="bye"))
    assert p.wait(30) == 0


def test_transports_are_registered_through_entry_points():
    reg = discover()
    for name in ("zmq", "shm", "nccl"):
        assert name in reg.transports
    assert reg.transports.get("zmq") is ZmqTransport
