"""Small helpers shared by the multi-process tests."""

import asyncio
import os
import time

import pytest

from mstar_core.cluster.cluster import WorkerLost

SHM_PREFIX = "mstar-shm-"


def shm_segments(*pids):
    """Shared-memory segments these processes created (other tests, under pytest-xdist, make their own)."""
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return sorted(n for n in names for p in pids if n.startswith(f"{SHM_PREFIX}{p}-"))


async def kv_pages_used(engine, worker: str, node: str, timeout: float = 5.0) -> int:
    """A worker's `kv_pages_used` for `node` from a heartbeat sent after this call (0 as soon as one says so)."""
    state = engine.cluster.workers[worker]
    asked = time.monotonic()
    deadline = asked + timeout
    while time.monotonic() < deadline:
        if state.last_seen > asked and state.load.get(node, {}).get("kv_pages_used") == 0:
            return 0
        await asyncio.sleep(0.05)
    return state.load[node]["kv_pages_used"]


async def until(condition, timeout: float, what: str) -> None:
    """Wait until `condition()` holds; an AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


async def kill_mid_request(engine, model: str, request: dict, worker: str, output: str, bound: float = 1.5) -> None:
    """Kill `worker` once `request`'s first `output` arrives; the request must fail naming it within `bound` s."""
    handle = engine.submit(model, dict(request))
    async for out in handle:
        if out.name == output:
            break
    else:
        raise AssertionError(f"the request ended without a '{output}' output")
    engine.cluster.kill(worker)
    killed_at = time.monotonic()
    with pytest.raises(WorkerLost, match=worker):
        await asyncio.wait_for(handle.result(), 20)
    assert time.monotonic() - killed_at < bound


def traffic(engine, worker: str) -> dict:
    """{direction: {tag: [count, bytes]}} through the serving process to and from `worker`, copied."""
    return {d: {t: list(v) for t, v in by.items()} for d, by in engine.cluster.workers[worker].traffic.items()}


async def peer_figure(engine, worker: str, key: str, at_least: int, timeout: float = 10.0):
    """A worker's peer-line figure `key` from its heartbeats, once it reaches `at_least`."""
    state = engine.cluster.workers[worker]
    deadline = time.monotonic() + timeout
    while (state.load.get("peer") or {}).get(key, -1) < at_least:
        assert time.monotonic() < deadline, (worker, key, at_least, state.load.get("peer"))
        await asyncio.sleep(0.05)
    return state.load["peer"][key]
