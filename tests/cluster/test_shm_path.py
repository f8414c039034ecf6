"""`transport: shm` for spawned workers: big tensors through shared memory, zero-copy receive, no leaks."""

import asyncio
import os
import signal
import time

import pytest
import torch

from mstar_core.cluster.cluster import WorkerLost
from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import Placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from tests.cluster.helpers import shm_segments

pytestmark = pytest.mark.timeout(120)


def placement(**control):
    return Placement.from_dict(
        {"workers": {"w": {"transport": "shm"}}, "nodes": {"bump": "w"}, "control": control or None}
    )


async def bump(engine, x):
    return (await engine.submit("fixture-blob", {"x": x}).result())["y"]


async def test_big_tensors_travel_through_shared_memory_and_arrive_zero_copy():
    engine = placed_engine(discover())
    await engine.load_model("fixture-blob", LoadOptions(), placement=placement())
    state = engine.cluster.workers["w"]
    worker_pid = state.process.pid
    x = torch.randn(512, 1024)  # 2 MiB: above the threshold
    y = await bump(engine, x)
    assert torch.equal(y, x + 1)
    assert state.link.sent_shm == 1 and state.link.received_shm == 1  # the input and the output
    address, nbytes = state.link.last_received[0]
    assert y.data_ptr() == address and nbytes == x.numel() * 4  # decoded straight from the mapping
    small = torch.arange(10.0)
    assert torch.equal(await bump(engine, small), small + 1)
    assert state.link.sent_shm == 1 and state.link.received_shm == 1  # small frames stay inline
    for _ in range(20):  # slots are released and reused: the arena does not grow without bound
        assert torch.equal(await bump(engine, x), x + 1)
    assert sum(s.size for s in state.link.arena.segments.values()) <= 64 << 20
    await engine.close()
    assert shm_segments(os.getpid(), worker_pid) == []


async def test_a_killed_worker_leaves_no_segment_and_its_replacement_serves():
    engine = placed_engine(discover())
    await engine.load_model("fixture-blob", LoadOptions(), placement=placement(heartbeat_interval=0.2))
    state = engine.cluster.workers["w"]
    x = torch.randn(256, 1024)
    old = state.process
    os.kill(old.pid, signal.SIGSTOP)  # the worker cannot map what we send next: its segment stays named
    try:
        pending = engine.submit("fixture-blob", {"x": x})
        deadline = time.monotonic() + 5
        while not shm_segments(os.getpid()) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert shm_segments(os.getpid()), "the input should sit in a named segment the stopped worker never mapped"
    finally:
        old.kill()  # SIGKILL reaches a stopped process; a failed assert must not leave it frozen forever
    with pytest.raises(WorkerLost, match="exited"):
        await pending.result()
    assert shm_segments(os.getpid(), old.pid) == []
    deadline = time.monotonic() + 30
    while not state.ready and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert state.process.pid != old.pid
    assert torch.equal(await bump(engine, x), x + 1)  # served through a fresh arena
    new_pid = state.process.pid
    await engine.close()
    assert shm_segments(os.getpid(), old.pid, new_pid) == []


def test_segments_a_killed_peer_never_handed_over_are_swept_when_it_is_lost():
    import subprocess
    import sys

    from mstar_transport_shm.link import ShmLink

    code = ("from mstar_transport_shm import Arena; a = Arena(1 << 20); a.put(memoryview(bytes(100_000)));"
            "print('ready', flush=True); import time; time.sleep(60)")
    peer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout.readline().strip() == "ready"
        assert len(shm_segments(peer.pid)) == 1  # written, never mapped by us: still named
    finally:
        peer.kill()
        peer.wait()
    link = ShmLink()
    link.peer_lost()  # what the server does when it detects the dead worker
    assert shm_segments(peer.pid) == []
    link.close()
