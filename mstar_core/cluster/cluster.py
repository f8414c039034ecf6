"""The coordinator side of multi-process serving: the control socket, its workers, and the calls sent to them.

`Cluster` composes parts that each own their state and do one job:

- `ControlSocket` (control_socket.py): the bound ROUTER socket, its secret, its encryption;
- `Handshake` (handshake.py) and `Sessions` (sessions.py): Hellos, Welcomes, sealed sessions, refused peers;
- `ControlReceiver` (receiver.py) and `WorkerMessages` (dispatch.py): the receive loop, each message to its worker;
- `WorkerSender` (sender.py): sealed sends to one worker;
- `WorkerCalls` (calls.py): node invocations, delegated loops, state moves, releases, replica groups;
- `WorkerPool` (worker_pool.py): adding, launching, loading, killing and shutting down workers;
- `Supervisor` (supervision.py): dead and hung workers replaced; `RankGroups` (rank_groups.py): tensor groups.

`RemoteNodeScheduler`s (remote_node.py) send through it; `WorkerLink` (worker_link.py) keeps each
worker's calls in flight.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

from mstar_core.cluster.calls import WorkerCalls
from mstar_core.cluster.control_socket import ControlSocket
from mstar_core.cluster.dispatch import WorkerMessages
from mstar_core.cluster.handshake import Handshake
from mstar_core.cluster.rank_groups import RankGroups
from mstar_core.cluster.receiver import ControlReceiver
from mstar_core.cluster.refusals import RefusalLog
from mstar_core.cluster.remote_node import RemoteNodeScheduler, ReplicaGroup
from mstar_core.cluster.sender import WorkerSender
from mstar_core.cluster.sessions import Sessions
from mstar_core.cluster.supervision import Supervisor
from mstar_core.cluster.worker_link import RemoteError, WorkerLink, WorkerLost
from mstar_core.cluster.worker_pool import WorkerPool
from mstar_core.config.placement import WorkerSpec
from mstar_core.runtime.engine import Invocation
from mstar_core.wire import LoadModel

__all__ = ["Cluster", "RemoteError", "RemoteNodeScheduler", "ReplicaGroup", "WorkerLost"]

log = logging.getLogger("mstar.cluster")


class Cluster:
    """Owns the control socket and every worker; `RemoteNodeScheduler`s send through it."""

    def __init__(self, bind: str | None = None, heartbeat_interval: float = 0.2, secret: bytes | None = None,
                 registry: Any = None, encrypt: bool | None = None):
        self.heartbeat_interval = heartbeat_interval
        self.refusals = RefusalLog(log)
        self.rank_groups = RankGroups()  # tensor-parallel groups: fail, restart and rendezvous as one
        self.socket = ControlSocket(bind, secret, encrypt)
        self.sender = WorkerSender(self.socket)
        self.sessions = Sessions()
        messages = WorkerMessages(self.refusals)
        self.pool = WorkerPool(self.socket, self.sender, messages.deliver, self.refusals, registry)
        self.supervisor = Supervisor(self.pool, self.rank_groups, heartbeat_interval, retire=self.sessions.retire,
                                     flush_soon=self.sender.flush_soon)
        self.pool.on_link_lost = functools.partial(self.supervisor.lost, kill=True)
        self.handshake = Handshake(self.socket, self.pool.workers, self.sessions, self.sender, self.supervisor,
                                   self.refusals, heartbeat_interval)
        self.receiver = ControlReceiver(self.socket, self.sessions, self.handshake, messages.deliver, self.refusals)
        self.calls = WorkerCalls(self.pool.workers, self.sender)
        self._supervising: asyncio.Task | None = None

    async def start(self) -> None:
        self.socket.open()
        self.receiver.ensure_receiving()
        self._supervising = asyncio.ensure_future(self.supervisor.run(self.receiver.ensure_receiving))

    # -- what the control link is ----------------------------------------------------------------

    @property
    def secret(self) -> bytes:
        return self.socket.secret

    @property
    def address(self) -> str:
        return self.socket.address

    @property
    def encrypted(self) -> bool:
        return self.socket.encrypted

    def tcp_address(self) -> str:
        return self.socket.tcp_address()

    @property
    def refused(self) -> int:
        """Peers that failed authentication."""
        return self.handshake.refused

    @property
    def closing(self) -> bool:
        return self.pool.closing

    # -- workers ---------------------------------------------------------------------------------

    @property
    def workers(self) -> dict[str, WorkerLink]:
        return self.pool.workers

    @property
    def on_requests_lost(self) -> Callable[[str, set[str], str], None] | None:
        """Called with (worker, request ids, why) when a worker is lost: fail those requests now."""
        return self.supervisor.on_requests_lost

    @on_requests_lost.setter
    def on_requests_lost(self, callback: Callable[[str, set[str], str], None] | None) -> None:
        self.supervisor.on_requests_lost = callback

    def add_worker(self, name: str, spec: WorkerSpec) -> WorkerLink:
        """The worker `name`; the first time a placement names it, its early Hello (if one came) is welcomed."""
        new = name not in self.pool.workers
        state = self.pool.add(name, spec)
        if new:
            self.handshake.welcome_early(state)
        return state

    async def ensure_worker(self, name: str, spec: WorkerSpec, timeout: float = 60.0) -> None:
        """Start (or wait for) a worker and return once it has joined; fail fast with its log if it cannot."""
        self.add_worker(name, spec)
        await self.pool.ensure_worker(name, spec, timeout)

    async def load(self, worker: str, msg: LoadModel, timeout: float = 600.0) -> None:
        await self.pool.load(worker, msg, timeout)

    def kill(self, worker: str) -> None:
        self.pool.kill(worker)

    def link_stats(self) -> dict[str, dict[str, Any]]:
        return self.pool.link_stats()

    def worker_processes(self) -> dict[str, tuple[int, str]]:
        return self.pool.worker_processes()

    # -- calls -----------------------------------------------------------------------------------

    def replica_group(self, replicas: list[str]) -> ReplicaGroup:
        return self.calls.replica_group(replicas)

    def invoke(self, worker: str, model: str, inv: Invocation) -> asyncio.Future:
        return self.calls.invoke(worker, model, inv)

    async def move_state(self, held: RemoteNodeScheduler, target: RemoteNodeScheduler, request_id: str, node: str,
                         export_index: int, import_index: int, *, arrival: float = 0.0) -> bool:
        return await self.calls.move_state(held, target, request_id, node, export_index, import_index, arrival=arrival)

    async def run_loop(self, worker: str, msg: Any, on_values: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        return await self.calls.run_loop(worker, msg, on_values)

    def release(self, worker: str, request_id: str) -> None:
        self.calls.release(worker, request_id)

    def notify(self, worker: str, msg: Any) -> None:
        self.calls.notify(worker, msg)

    # -- closing ---------------------------------------------------------------------------------

    async def close(self) -> None:
        self.receiver.stop()
        await self.pool.close()
        if self._supervising is not None:
            self._supervising.cancel()
        self.handshake.close()
        self.receiver.close()
        self.rank_groups.close()
        self.socket.close()
