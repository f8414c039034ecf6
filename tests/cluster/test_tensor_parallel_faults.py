"""A rank that dies or hangs fails its tensor-parallel group: its requests fail at once, the group is replaced whole.

Two TP=2 groups of the tiny llama (`replicas: 2`, 4 rank processes). Killing (or stopping) a follower
rank of group 0 fails that group's request within the detection window, takes its rank 0 down with
it, and the group serves again after its replacement, while a request on group 1 runs to its end.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import zlib

import pytest

from mstar_core.cluster.strategy import placed_engine
from mstar_core.cluster.worker_link import WorkerLost
from mstar_core.config import Placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from tests.cluster.helpers import until

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

PLACEMENT = {"workers": {"tp": {"tensor_parallel": 2, "replicas": 2, "threads": 1}}, "nodes": {"lm": "tp"},
             "control": {"heartbeat_interval": 0.2}}
LONG = {"input_ids": [5, 6, 7, 8, 9], "max_tokens": 1500, "ignore_eos": True, "temperature": 0.0}


def request_id_on(replica: int, tag: str) -> str:
    """A request id the replica group sends to replica `replica` of 2 while both are ready."""
    return next(f"{tag}-{i}" for i in range(1000) if zlib.crc32(f"{tag}-{i}".encode()) % 2 == replica)


async def first_token(handle) -> None:
    async for out in handle:
        if out.name == "next_token":
            return


@pytest.mark.parametrize("fault", ["kill", "stop"])
async def test_a_lost_rank_fails_its_group_which_is_replaced_while_the_other_group_serves(fault):
    engine = placed_engine(discover())
    await engine.load_model("llama", LoadOptions(preset="tiny"), placement=Placement.from_dict(PLACEMENT))
    workers = engine.cluster.workers
    try:
        doomed = engine.submit("llama", dict(LONG), request_id=request_id_on(0, "doomed"))
        healthy = engine.submit("llama", {**LONG, "max_tokens": 60}, request_id=request_id_on(1, "healthy"))
        await first_token(doomed)
        await first_token(healthy)
        follower, leader = workers["tp.0.rank1"], workers["tp.0"]
        old_pids = (follower.pid, leader.pid)
        os.kill(follower.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        hit = time.monotonic()
        with pytest.raises(WorkerLost, match=r"tp\.0"):
            await asyncio.wait_for(doomed.result(), 20)
        assert time.monotonic() - hit <= 1.5  # (a stopped rank: the 1 s heartbeat silence, then the group goes)
        tokens = [o.value async for o in healthy if o.name == "next_token"]
        assert len(tokens) == 59  # the other group's request ran to its end (one token was read above)
        await until(lambda: leader.ready and follower.ready, 10 - (time.monotonic() - hit), "the group back")
        assert (follower.pid, leader.pid) != old_pids and old_pids[1] != leader.pid  # both ranks replaced
        again = engine.submit("llama", {**LONG, "max_tokens": 8}, request_id=request_id_on(0, "again"))
        assert len([o async for o in again if o.name == "next_token"]) == 8
    finally:
        if fault == "stop":
            for state in workers.values():
                try:
                    os.kill(state.pid, signal.SIGCONT)
                except (OSError, TypeError):
                    pass
        await engine.close()
