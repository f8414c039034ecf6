"""Calls to workers that someone awaits: node invocations, delegated loops, state moves; and their release.

Each call is a future parked on its worker's `WorkerLink` (`inflight`, `loops`), resolved when the
answer comes back through the receive loop, or failed at once when the worker is lost. A value
that cannot travel fails its request (a 400) before anything was sent, never the worker.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Mapping
from typing import Any

from mstar_core.cluster.remote_node import RemoteNodeScheduler, ReplicaGroup
from mstar_core.cluster.remote_values import to_wire
from mstar_core.cluster.sender import WorkerSender
from mstar_core.cluster.worker_link import WorkerLink
from mstar_core.errors import RequestError
from mstar_core.runtime.engine import Invocation
from mstar_core.wire import InvokeNode, Release, WireError
from mstar_core.wire.session import new_session_id


class WorkerCalls:
    """Starts calls on workers and keeps the replica groups that choose which replica a request's calls go to."""

    def __init__(self, workers: Mapping[str, WorkerLink], sender: WorkerSender):
        self.workers = workers
        self.sender = sender
        self._groups: dict[tuple[str, ...], ReplicaGroup] = {}

    def replica_group(self, replicas: list[str]) -> ReplicaGroup:
        """The one `ReplicaGroup` of these replicas (nodes on the same workers share it)."""
        key = tuple(replicas)
        if key not in self._groups:
            self._groups[key] = ReplicaGroup(self, key)
        return self._groups[key]

    def invoke(self, worker: str, model: str, inv: Invocation) -> asyncio.Future:
        state = self.workers[worker]
        future = asyncio.get_running_loop().create_future()
        node = f"{model}/{inv.node}"
        try:
            state.check_request(inv.request_id)
            frames = state.encode(InvokeNode(request_id=inv.request_id, node=node, call_index=inv.call_index,
                                             inputs=to_wire(inv.inputs), options=to_wire(dict(inv.options)),
                                             arrival=inv.arrival, priority=inv.priority))
        except WireError as exc:  # the request's own values cannot travel: the client's to fix, not a lost worker
            future.set_exception(RequestError(f"request {inv.request_id}: an input of node '{inv.node}' cannot be "
                                              f"sent to worker '{worker}': {exc}", status=400))
            return future
        except RequestError as exc:
            future.set_exception(exc)
            return future
        state.inflight[(inv.request_id, node, inv.call_index)] = future
        sent = time.perf_counter()
        future.add_done_callback(
            lambda f: f.cancelled() or f.exception() is not None or state.observe_round_trip(time.perf_counter() - sent))
        asyncio.ensure_future(self.sender.send_or_fail(state, frames, future))
        return future

    async def move_state(self, held: RemoteNodeScheduler, target: RemoteNodeScheduler, request_id: str, node: str,
                         export_index: int, import_index: int, *, arrival: float = 0.0) -> bool:
        """Move a request's engine state for `node` from `held`'s worker straight to `target`'s (no tensor through here).

        Both get one control message naming a fresh move (nonce, session id): the exporter sends the
        sealed state to the importer's peer mailbox (`peer_mailbox.PeerMailbox`). False when it cannot go
        direct (same worker, or the target has not reported its mailbox yet): the caller moves it itself.
        """
        src, dst = held.replica_for(request_id), target.replica_for(request_id)
        address = (self.workers[dst].load.get("peer") or {}).get("address")
        if src == dst or not isinstance(address, str):
            return False
        move = {"peer_nonce": secrets.token_hex(16), "peer_session": new_session_id()}
        # the moves carry the request's arrival: a worker admitting oldest first must not take them for the oldest
        imported = self.invoke(dst, target.model, Invocation(request_id, node, {}, {"transfer": "import", **move},
                                                             import_index, arrival=arrival))
        exported = self.invoke(src, held.model, Invocation(request_id, node, {}, {"transfer": "export", "peer_to": address,
                                                                                  **move}, export_index, arrival=arrival))
        try:
            await exported
            await imported
        finally:
            for future in (exported, imported):
                if not future.done():
                    future.cancel()
                elif not future.cancelled():
                    future.exception()  # retrieved: the first failure is the one raised
        return True

    async def run_loop(self, worker: str, msg: Any, on_values: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """Run a walk's loop (a `RunLoop`) or a stream's consumer (a `RunConsumer`) on `worker`.

        `on_values(call, outputs)` sees its visible values in order. Returns the env names it changed
        and, per stream index, the items it sent straight to another worker. A WireError (an env
        value that cannot travel) surfaces before anything was sent, so the caller can run it itself.
        """
        state = self.workers[worker]
        frames = state.encode(msg)
        state.check_request(msg.request_id)
        key = (msg.request_id, msg.loop, msg.branch)  # fan-out branches run copies of one loop at once
        future = asyncio.get_running_loop().create_future()
        state.loops[key] = (future, on_values)
        try:
            await self.sender.send_frames(state, frames)
            return await future
        finally:
            state.loops.pop(key, None)

    def release(self, worker: str, request_id: str) -> None:
        """The request ended: cancel what of it still waits on `worker`, and tell the worker to free its state."""
        state = self.workers.get(worker)
        if state is None:
            return
        state.forget(request_id)
        if not state.alive or state.channel is None:
            return
        self.sender.notify(state, Release(request_id=request_id))

    def notify(self, worker: str, msg: Any) -> None:
        """Send a control message that needs no answer; a worker that is gone takes its requests with it."""
        self.sender.notify(self.workers.get(worker), msg)
