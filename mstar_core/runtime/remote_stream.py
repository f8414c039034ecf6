"""Streams between two workers go peer to peer: the serving process's side (the workers' is `peer_streams.py`).

When a stream's producer runs in a loop delegated to one worker and its consumer (a per-chunk node
call, or a consumer fragment) lives wholly on another, the items go straight from the first
worker to the second, whose copy of the stream runs the chunk policy and the consumer. The serving
process sends the consumer's worker a `RunConsumer` and, once the producing stage ended, a
`StreamEnd` with the number of items sent; it sees the consumer's visible outputs (emitted values,
lists a per-chunk consumer collects) as it would for a delegated loop, never the chunks.

Anything else (a producer called outside such a loop, both ends on one worker, an end in this
process, a worker whose peer mailbox is not known yet) keeps the stream here, as before.
"""

from __future__ import annotations

import secrets
from typing import Any

from mstar_core.errors import RequestError
from mstar_core.graph.walk import StreamingGraphEdge
from mstar_core.runtime.cluster import Cluster, RemoteNodeScheduler
from mstar_core.runtime.conductor import Conductor, RequestState, WalkFrame
from mstar_core.runtime.remote_values import to_wire
from mstar_core.runtime.sites import (
    CallSite,
    LoopSite,
    ParallelSite,
    SequenceSite,
    Site,
    WalkSites,
    iter_call_sites,
)
from mstar_core.wire import WireError
from mstar_core.wire.messages import RunConsumer, StreamEnd
from mstar_core.wire.session import new_session_id


class StreamPlan:
    """One stream of one walk that goes worker to worker when a request's two ends land on two workers."""

    def __init__(self, cluster: Cluster, model: str, walk: str, index: int, edge: StreamingGraphEdge,
                 producer: RemoteNodeScheduler, consumer: RemoteNodeScheduler, calls: list[CallSite]):
        self.cluster = cluster
        self.model = model
        self.walk = walk
        self.index = index
        self.edge = edge
        self.producer = producer
        self.consumer = consumer
        self.calls = calls  # the consumer's call sites, in the order its worker numbers forwarded values

    def open(self, request_id: str) -> DirectStream | None:
        """This request's stream, if its ends are on two workers and the consumer's mailbox is known; else None."""
        src, dst = self.producer.replica_for(request_id), self.consumer.replica_for(request_id)
        address = (self.cluster.workers[dst].load.get("peer") or {}).get("address")
        if src == dst or not isinstance(address, str):
            return None
        return DirectStream(self, request_id, dst, address)


class DirectStream:
    """One request's stream going worker to worker: the route its producer loop sends on, and its consumer's run."""

    __slots__ = ("address", "closed", "edge", "nonce", "plan", "request_id", "sent", "session", "worker")

    def __init__(self, plan: StreamPlan, request_id: str, worker: str, address: str):
        self.plan = plan
        self.edge = plan.edge
        self.request_id = request_id
        self.worker = worker
        self.address = address
        self.nonce, self.session = secrets.token_hex(16), new_session_id()
        self.sent = 0  # items the producer's loop runs reported sending
        self.closed = False

    def route(self) -> dict[str, Any]:
        """Where a producing loop sends the items (`RunLoop.streams`)."""
        return {"to": self.address, "nonce": self.nonce, "session": self.session, "start": self.sent}

    def close(self) -> None:
        """The producing stage ended: the consumer's worker closes the stream once all `sent` items arrived."""
        if self.closed:
            return
        self.closed = True
        self.plan.cluster.notify(self.worker, StreamEnd(request_id=self.request_id, stream=self.plan.index,
                                                        items=self.sent))

    async def consume(self, conductor: Conductor, state: RequestState, frame: WalkFrame, env: dict[str, Any],
                      entry: dict[str, Any]) -> None:
        """Run the consumer on its worker; its visible outputs come back here as a local consumer's would."""
        plan, edge = self.plan, self.edge
        for node in {c.node for c in plan.calls}:
            await conductor.hold(state, node, conductor.scheduler_for(plan.walk, node))
        if edge.consumer is None:
            site = plan.calls[0]
            names = [n for p, n in (*site.inputs, *site.optional_inputs) if p != edge.dst_input and n in env]
            sent = {n: env[n] for n in names}

            def on_values(call: int, outputs: dict[str, Any]) -> None:
                conductor.collect(state, frame, site, edge, env, outputs)
        else:
            sent = entry
            fragment, scratch = frame.fragment({}), dict(entry)

            def on_values(call: int, outputs: dict[str, Any]) -> None:
                site = plan.calls[call]
                conductor.after_call(state, fragment, site.call, outputs, scratch, site)
        try:
            msg = RunConsumer(request_id=self.request_id, model=plan.model, walk=plan.walk, stream=plan.index,
                              env=to_wire(sent), nonce=self.nonce, session=self.session, branch=frame.branch_key,
                              arrival=state.arrival)
            delta, _ = await plan.cluster.run_loop(self.worker, msg, on_values)
        except WireError as exc:
            raise RequestError(f"request {self.request_id}: an input of the consumer of stream {edge.name} cannot be "
                               f"sent to worker '{self.worker}': {exc}", status=400) from None
        env.update(delta)


def plan_direct_streams(conductor: Conductor, cluster: Cluster, model: str) -> int:
    """Mark every stream whose producer runs in one delegated loop and whose consumer lives on one worker group.

    Call after `delegate_loops`. Returns the number of streams marked; a request still keeps a
    stream here when its two ends land on the same worker.
    """
    count = 0
    for name, sites in conductor.sites.items():
        for k, edge in enumerate(sites.walk.streams):
            plan = _plan(conductor, cluster, model, sites, k, edge)
            if plan is not None:
                conductor.direct_streams.setdefault(name, {})[k] = plan
                count += 1
    return count


def _plan(conductor: Conductor, cluster: Cluster, model: str, sites: WalkSites, k: int,
          edge: StreamingGraphEdge) -> StreamPlan | None:
    name = sites.walk.name
    if k not in sites.closes[None]:
        return None  # produced by another stream's consumer: it stays where that consumer's values arrive
    loop = _producing_loop(conductor, sites, edge.src_node)
    if loop is None:
        return None
    producer = conductor.remote_loops[name, loop.index].scheduler
    calls = [sites.stream_calls[k]] if edge.consumer is None else list(iter_call_sites(sites.consumers[k]))
    scheds = [conductor.scheduler_for(name, c.node) for c in calls]
    if not scheds or not all(isinstance(s, RemoteNodeScheduler) for s in scheds) or \
            len({tuple(s.replicas) for s in scheds}) != 1 or tuple(scheds[0].replicas) == tuple(producer.replicas):
        return None
    if any((name, c.node) in conductor.walk_schedulers for c in calls):
        return None  # a per-walk node's state may have to move first: keep the consumer's calls here
    return StreamPlan(cluster, model, name, k, edge, producer, scheds[0], calls)


def _producing_loop(conductor: Conductor, sites: WalkSites, node: str) -> LoopSite | None:
    """The delegated loop holding every call of `node` in the walk, run once at a time (not in a Parallel); or None."""
    calls = [c for c in iter_call_sites(sites.body) if c.node == node]
    elsewhere = [c for s in (*sites.consumers.values(), *sites.stream_calls.values())
                 for c in iter_call_sites(s) if c.node == node]
    if not calls or elsewhere:
        return None
    for loop, in_parallel in _loops(sites.body, False):
        if (sites.walk.name, loop.index) in conductor.remote_loops:
            inside = [c for c in calls if c.path[: len(loop.path)] == loop.path]
            if inside:
                return loop if len(inside) == len(calls) and not in_parallel else None
    return None


def _loops(site: Site, in_parallel: bool):
    """(loop site, whether a Parallel encloses it), outermost first."""
    if isinstance(site, LoopSite):
        yield site, in_parallel
        yield from _loops(site.body, in_parallel)
    elif isinstance(site, SequenceSite):
        for s in site.steps:
            yield from _loops(s, in_parallel)
    elif isinstance(site, ParallelSite):
        for s in site.branches:
            yield from _loops(s, True)
