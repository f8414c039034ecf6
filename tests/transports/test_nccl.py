"""torch.distributed transport: two real processes on loopback (gloo on CPU, NCCL when CUDA)."""

from __future__ import annotations

import pytest
import torch
from mstar_transport_nccl import NcclTransport

from mstar_core.wire import InvokeNode, NodeResult, Release, TransportError
from mstar_core.wire.transport import free_tcp_port


def test_two_processes_echo_over_gloo(spawn):
    addr = f"tcp://127.0.0.1:{free_tcp_port()}"
    p = spawn("echo", "nccl", addr, "")
    t = NcclTransport(backend="gloo", timeout_s=30)
    t.bind(addr)
    try:
        assert t.recv_msg() == Release(request_id="hello")
        x = torch.randn(3, 5).t()
        t.send_msg(InvokeNode(request_id="r", node="n", call_index=2, inputs={"x": x, "e": torch.empty(0, 2)}))
        out = t.recv_msg()
        assert isinstance(out, NodeResult) and torch.equal(out.outputs["x"], x * 2)
        assert out.outputs["e"].shape == (0, 2)
        t.send_msg(Release(request_id="bye"))
    finally:
        t.close()
    assert p.wait(30) == 0


def test_bad_options():
    with pytest.raises(TransportError, match="backend must be"):
        NcclTransport(backend="mpi")
    if not torch.cuda.is_available():
        with pytest.raises(TransportError, match="needs CUDA"):
            NcclTransport(backend="nccl")
    with pytest.raises(TransportError, match="not a loopback address"):
        NcclTransport(backend="gloo").bind("tcp://0.0.0.0:1234")
    with pytest.raises(TransportError, match="tcp://HOST:PORT"):
        NcclTransport(backend="gloo").connect("ipc:///tmp/x")
