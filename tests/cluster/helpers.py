"""Small helpers shared by the multi-process tests."""

import asyncio
import os
import time

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
