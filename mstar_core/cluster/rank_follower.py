"""A worker's side of a tensor-parallel group: joining the torch.distributed group, and following rank 0's steps.

Rank 0 is an ordinary worker whose split engines send each step to the group. A follower (rank
1..N-1) builds the same engines on its shards but runs no scheduler: one thread receives rank 0's
messages and hands each to the engine it names (`follow`). A follower whose channel breaks has lost
its rank 0, so it exits; the server replaces the whole group.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from typing import Any

import torch
import torch.distributed as dist

from mstar_core.nn.parallel import TensorParallelGroup
from mstar_core.runtime.rank_steps import RankChannel, group_broken

log = logging.getLogger("mstar.worker")

#: How long one collective (a follower waiting for rank 0's next step, say) may wait.
IDLE_TIMEOUT = datetime.timedelta(days=7)


def join_rank_group(setup: dict[str, Any], device: str) -> tuple[TensorParallelGroup, RankChannel]:
    """Join the group `setup` describes (a `LoadModel.tensor_parallel`) as this process's default group."""
    rank, size = int(setup["rank"]), int(setup["size"])
    host, _, port = str(setup["store"]).rpartition(":")
    timeout = datetime.timedelta(seconds=float(setup.get("timeout_s", 60)))
    backend = str(setup.get("backend") or ("nccl" if device.startswith("cuda") else "gloo"))
    store = dist.PrefixStore(f"{setup['prefix']}/", dist.TCPStore(host, int(port), is_master=False, timeout=timeout))
    if backend == "gloo" and host.startswith("127.") and os.path.isdir("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's own sockets on loopback too, like the store
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    # a collective may wait as long as a follower idles between requests: a dead or hung rank is the
    # supervisor's to find (heartbeats, process exits), and it replaces the whole group
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=IDLE_TIMEOUT)
    group = TensorParallelGroup(rank, size, expert_parallel=bool(setup.get("expert_parallel")))
    return group, RankChannel(rank, size, None, device if backend == "nccl" else "cpu")


class RankFollower:
    """Runs rank 0's messages on this follower's engines, by 'model/node', on a thread of its own."""

    def __init__(self, worker: str, channel: RankChannel):
        self.worker, self.channel = worker, channel
        self.engines: dict[str, Any] = {}
        self.steps = 0
        self._thread: threading.Thread | None = None

    def add(self, key: str, engine: Any) -> None:
        self.engines[key] = engine

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=f"mstar-follower-{self.worker}", daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                msg = self.channel.receive()
            except Exception as exc:
                log.error("worker %s: rank 0 of its tensor-parallel group is gone (%s); exiting", self.worker, exc)
                os._exit(3)
            engine = self.engines.get(msg.header.get("engine"))
            if engine is None:  # out of step with rank 0: nothing this rank computes can be right any more
                log.error("worker %s: rank 0 sent a step for %r, which this rank does not host; exiting",
                          self.worker, msg.header.get("engine"))
                os._exit(3)
            try:
                engine.follow(msg)
            except Exception as exc:  # rank 0 ran the same inputs: it fails that call the same way and goes on
                if group_broken(exc):
                    log.error("worker %s: its tensor-parallel group broke (%s); exiting", self.worker, exc)
                    os._exit(3)
                log.exception("worker %s: a followed step failed", self.worker)
            self.steps += 1
