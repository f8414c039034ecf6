"""Nodes whose engines live in worker processes, as the conductor sees them: schedulers over replicas."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Mapping
from typing import Any, Protocol

import attrs

from mstar_core.cluster.worker_link import WorkerLink, WorkerLost
from mstar_core.runtime.engine import Invocation


class NodeCalls(Protocol):
    """What remote nodes need of the control plane (`calls.WorkerCalls`, through `Cluster`): workers, calls to them."""

    workers: Mapping[str, WorkerLink]

    def invoke(self, worker: str, model: str, inv: Invocation) -> asyncio.Future: ...

    def release(self, worker: str, request_id: str) -> None: ...

    def replica_group(self, replicas: list[str]) -> ReplicaGroup: ...


class ReplicaGroup:
    """The replicas of one worker group: a new request goes to a ready one, a started request stays on its own.

    The choice is a hash of the request id over the replicas ready when it starts (over all of
    them when none is, so the request fails at once with WorkerLost). It is shared by every node
    on the group, so one request's nodes (and a loop delegated to them) meet on the same replica.
    """

    def __init__(self, cluster: NodeCalls, replicas: tuple[str, ...]):
        self.cluster = cluster
        self.replicas = replicas
        self._sticky: dict[str, str] = {}

    def pick(self, request_id: str) -> str:
        replica = self._sticky.get(request_id)
        if replica is None:
            ready = [r for r in self.replicas if self._ready(r)] or list(self.replicas)
            replica = self._sticky[request_id] = ready[zlib.crc32(request_id.encode()) % len(ready)]
        return replica

    def down(self) -> bool:
        """True while no replica is ready (all dead or restarting): a new request could only fail."""
        return not any(self._ready(r) for r in self.replicas)

    def _ready(self, replica: str) -> bool:
        state = self.cluster.workers.get(replica)
        if state is None or not state.ready:
            return False
        # a process that has exited is not ready, even before supervision's next round notices: a new request
        # picked in that gap would go to the dead replica and fail while another one is alive
        process = getattr(state, "process", None)
        return process is None or process.poll() is None

    def release(self, request_id: str) -> None:
        replica = self._sticky.pop(request_id, None)
        if replica is not None:
            self.cluster.release(replica, request_id)


class RemoteNodeScheduler:
    """Stands in for a `NodeScheduler` whose engine lives in worker processes (see `ReplicaGroup`)."""

    def __init__(self, cluster: NodeCalls, model: str, node: str, replicas: list[str]):
        self.cluster = cluster
        self.model = model
        self.node = node
        self.replicas = replicas
        self.group = cluster.replica_group(replicas)

    def replica_for(self, request_id: str) -> str:
        return self.group.pick(request_id)

    def check_available(self) -> None:
        """Raise `WorkerLost` (503, retryable) while a new request cannot use this node (no replica ready)."""
        if self.group.down():
            raise WorkerLost(f"node '{self.node}' of model '{self.model}' has no ready worker "
                             f"({', '.join(self.replicas)} restarting); retry the request shortly")

    def submit(self, invocation: Invocation) -> asyncio.Future:
        if invocation.node != self.node:  # a composed model calls a part's node by its own name ('llm/lm')
            invocation = attrs.evolve(invocation, node=self.node)
        return self.cluster.invoke(self.replica_for(invocation.request_id), self.model, invocation)

    def release(self, request_id: str) -> None:
        self.group.release(request_id)

    def stats(self) -> dict[str, dict[str, Any]]:
        """This node's engine gauges on each live replica, from its last heartbeat."""
        key = f"{self.model}/{self.node}"
        out = {}
        for replica in self.replicas:
            state = self.cluster.workers.get(replica)
            if state is not None and state.alive and key in state.load:
                out[replica] = state.load[key]
        return out

    async def close(self) -> None:
        return None
