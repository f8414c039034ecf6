"""Shared-memory transport: zero-copy receive, slot reuse, growth, and no segment left when a process dies."""

from __future__ import annotations

import gc
import os
import signal
import time

import pytest
import torch
from mstar_transport_shm import Arena, ShmTransport, segment_names, sweep_stale

from mstar_core.wire import InvokeNode, NodeResult, Release, TransportError, decode


def _pair(**kw):
    a = ShmTransport(**kw)
    addr = a.bind()
    b = ShmTransport(**kw)
    b.connect(addr)
    b.send_msg(Release(request_id="hello"))
    assert a.recv_msg(5) == Release(request_id="hello")
    return a, b


def _msg(x, **extra):
    return InvokeNode(request_id="r", node="n", call_index=0, inputs={"x": x, **extra})


def _wait(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def test_roundtrip_zero_copy_and_name_unlinked_once_mapped():
    a, b = _pair()
    with a, b:
        x = torch.randn(1 << 20)
        a.send_msg(_msg(x, small=torch.arange(3)))
        frames = b.recv(5)
        assert isinstance(frames[1], memoryview) and frames[1].nbytes == x.numel() * 4
        m = decode(frames)
        assert torch.equal(m.inputs["x"], x) and torch.equal(m.inputs["small"], torch.arange(3))
        b.send_msg(Release(request_id="ack"))
        a.recv_msg(5)
        seg = next(iter(a._arena.segments.values()))
        assert not seg.linked and segment_names(os.getpid()) == []  # name gone as soon as it was mapped


def test_slots_return_when_the_receiver_drops_its_tensors():
    a, b = _pair(segment_bytes=8 << 20)
    with a, b:
        for i in range(10):  # 10 x 4 MiB through one 8 MiB segment: only works if slots come back
            a.send_msg(_msg(torch.full((1 << 20,), float(i))))
            m = b.recv_msg(5)
            assert m.inputs["x"][0].item() == i
            del m
            gc.collect()
            b.send_msg(Release(request_id=str(i)))
            a.recv_msg(5)
        assert len(a._arena.segments) == 1


def test_held_tensors_make_the_arena_grow_then_fall_back_inline():
    a, b = _pair(segment_bytes=1 << 20, max_bytes=3 << 20)
    with a, b:
        held = []
        for i in range(5):  # 5 held x 1 MiB: 3 fit in the arena, then inline over zmq
            a.send_msg(_msg(torch.full((1 << 18,), float(i))))
            held.append(b.recv_msg(5).inputs["x"])
        assert [int(t[0].item()) for t in held] == list(range(5))
        assert sum(s.size for s in a._arena.segments.values()) <= 3 << 20


def test_bind_is_same_host_only():
    with pytest.raises(TransportError, match="same-host only"):
        ShmTransport().bind("tcp://10.0.0.1:5555")


def test_killed_sender_leaves_no_segment(spawn):
    a = ShmTransport()
    addr = a.bind()
    p = spawn("shm_sender", addr)
    with a:
        m = a.recv_msg(30)
        assert torch.equal(m.inputs["x"], torch.arange(1 << 20, dtype=torch.int32))
        assert _wait(lambda: segment_names(p.pid) == []), segment_names(p.pid)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        assert segment_names(p.pid) == []
        # Our mapping keeps the data alive after the owner died.
        assert int(m.inputs["x"][-1].item()) == (1 << 20) - 1


def test_orphaned_segment_of_a_killed_owner_is_swept(spawn):
    p = spawn("shm_orphan")
    name = p.stdout.readline().strip()
    assert name in segment_names(p.pid)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    Arena().close()  # every new arena sweeps the dead owners' leftovers
    assert segment_names(p.pid) == []
    assert sweep_stale() == []


def test_close_unlinks_everything():
    a, b = _pair()
    a.send_msg(_msg(torch.zeros(1 << 20)))
    # b never receives, so the segment is still named
    assert segment_names(os.getpid()) != []
    a.close()
    b.close()
    assert segment_names(os.getpid()) == []


def test_two_processes_echo(spawn):
    a = ShmTransport()
    addr = a.bind()
    p = spawn("echo", "shm", addr, "")
    with a:
        assert a.recv_msg(30) == Release(request_id="hello")
        for n in (10, 1 << 20):
            x = torch.randn(n)
            a.send_msg(_msg(x))
            out = a.recv_msg(30)
            assert isinstance(out, NodeResult) and torch.equal(out.outputs["x"], x * 2)
        a.send_msg(Release(request_id="bye"))
    assert p.wait(30) == 0
    assert segment_names(p.pid) == [] and segment_names(os.getpid()) == []
