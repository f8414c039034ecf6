"""Peer process for transport tests (run as a script): the other end of a real two-process channel."""

from __future__ import annotations

import sys
import time

import torch

from mstar_core.wire import InvokeNode, NodeResult, Release


def shm_sender(address: str) -> None:
    """Connect, send one 4 MiB tensor, then wait forever (the test kills us)."""
    from mstar_transport_shm import ShmTransport

    t = ShmTransport()
    t.connect(address)
    t.send_msg(InvokeNode(request_id="r", node="n", call_index=0, inputs={"x": torch.arange(1 << 20, dtype=torch.int32)}))
    print("sent", flush=True)
    while True:
        try:
            t.recv(1.0)  # also processes the receiver's "mapped" notice, which unlinks the segment name
        except TimeoutError:
            pass


def shm_orphan() -> None:
    """Create a segment nobody maps, report its name, then wait to be killed."""
    from mstar_transport_shm import Arena

    a = Arena(segment_bytes=1 << 20)
    name, _, _ = a.put(memoryview(bytes(100_000)))
    print(name, flush=True)
    time.sleep(600)


def echo(kind: str, address: str, secret: str) -> None:
    """Connect with the given transport, then echo every InvokeNode back as a NodeResult until Release."""
    if kind == "zmq":
        from mstar_transport_zmq import ZmqTransport as T
        t = T(secret=secret.encode() or None)
    elif kind == "shm":
        from mstar_transport_shm import ShmTransport as T
        t = T()
    else:
        from mstar_transport_nccl import NcclTransport as T
        t = T(timeout_s=30)
    t.connect(address)
    t.send_msg(Release(request_id="hello"))
    while True:
        m = t.recv_msg(30)
        if isinstance(m, Release):
            break
        t.send_msg(NodeResult(request_id=m.request_id, node=m.node, call_index=m.call_index,
                              outputs={k: v * 2 if isinstance(v, torch.Tensor) else v for k, v in m.inputs.items()}))
    t.close()


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    {"shm_sender": shm_sender, "shm_orphan": shm_orphan, "echo": echo}[mode](*args)
