"""Streams between workers go peer to peer: the serving process's side (the workers' is `peer_streams.py`).

When a stream's producer runs on a worker as a whole stage (in loops delegated to it, also loops in
Parallel branches or fan-out copies feeding the stream at once, or in the consumer of another stream
that itself runs on a worker) and its consumer (a per-chunk node call,
or a consumer fragment) lives wholly on one worker group, the items go straight from the first
worker to the second, whose copy of the stream runs the chunk policy and the consumer. Both ends
on one worker use the same line (the worker sends to its own mailbox), so the chunks never come
here either. The serving process sends the consumer's worker a `RunConsumer` and, once the
producing stage ended, a `StreamEnd` with the number of items sent; it sees the consumer's visible
outputs (emitted values, lists a per-chunk consumer collects) as it would for a delegated loop,
never the chunks.

Anything else keeps the stream here, as before: a producer called from here one call at a time
(its outputs come here anyway), an end in this process, a per-walk node, a worker whose peer mailbox
is not known yet, and a stream whose producing consumer stays here for the request.
"""

from __future__ import annotations

import secrets
from typing import Any

from mstar_core.cluster.cluster import Cluster, RemoteNodeScheduler
from mstar_core.cluster.remote_values import to_wire
from mstar_core.errors import RequestError
from mstar_core.graph.walk import StreamingGraphEdge
from mstar_core.runtime.conductor import Conductor, RequestState, WalkFrame
from mstar_core.runtime.sites import (
    CallSite,
    LoopSite,
    WalkSites,
    iter_call_sites,
)
from mstar_core.wire import WireError
from mstar_core.wire.messages import RunConsumer, StreamEnd
from mstar_core.wire.session import new_session_id


class StreamPlan:
    """One stream of one walk that goes worker to worker: where its producer and its consumer run."""

    def __init__(self, cluster: Cluster, model: str, walk: str, index: int, edge: StreamingGraphEdge,
                 consumer: RemoteNodeScheduler, calls: list[CallSite], parent: StreamPlan | None = None):
        self.cluster = cluster
        self.model = model
        self.walk = walk
        self.index = index
        self.edge = edge
        self.consumer = consumer
        self.calls = calls  # the consumer's call sites, in the order its worker numbers forwarded values
        # the stream whose consumer produces this one (None: a delegated loop of the walk's body does)
        self.parent = parent

    def target(self, request_id: str) -> tuple[str, str] | None:
        """(consumer worker, its peer mailbox address) for this request, or None if the stream stays here."""
        if self.parent is not None and self.parent.target(request_id) is None:
            return None  # the producing consumer runs here for this request: so are the items
        worker = self.consumer.replica_for(request_id)
        address = (self.cluster.workers[worker].load.get("peer") or {}).get("address")
        return (worker, address) if isinstance(address, str) else None

    def open(self, request_id: str) -> DirectStream | None:
        """This request's stream going worker to worker, or None when it stays here."""
        target = self.target(request_id)
        return None if target is None else DirectStream(self, request_id, *target)


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
        # the streams this consumer produces that go on worker to worker: its worker sends their items itself
        routes = {k: r for k, r in frame.routes.items() if r.plan.parent is plan}
        try:
            msg = RunConsumer(request_id=self.request_id, model=plan.model, walk=plan.walk, stream=plan.index,
                              env=to_wire(sent), nonce=self.nonce, session=self.session, branch=frame.branch_key,
                              arrival=state.arrival, priority=state.priority,
                              streams={str(k): r.route() for k, r in routes.items()})
            delta, streamed = await plan.cluster.run_loop(self.worker, msg, on_values)
        except WireError as exc:
            raise RequestError(f"request {self.request_id}: an input of the consumer of stream {edge.name} cannot be "
                               f"sent to worker '{self.worker}': {exc}", status=400) from None
        for k, count in streamed.items():
            routes[int(k)].sent += int(count)
        env.update(delta)


def plan_direct_streams(conductor: Conductor, cluster: Cluster, model: str) -> int:
    """Mark every stream whose producing stage and whose consumer each run wholly on one worker group.

    Call after `delegate_loops`. A stream produced by another stream's consumer is marked once
    that stream is (it goes direct only for requests whose producing consumer runs on its
    worker). Returns the number of streams marked.
    """
    count = 0
    for name, sites in conductor.sites.items():
        plans: dict[int, StreamPlan] = {}
        changed = True
        while changed:  # a chained stream is planned in the pass after the one that planned its parent
            changed = False
            for k, edge in enumerate(sites.walk.streams):
                if k not in plans and (plan := _plan(conductor, cluster, model, sites, k, edge, plans)) is not None:
                    plans[k] = plan
                    changed = True
        if plans:
            conductor.direct_streams[name] = plans
        count += len(plans)
    return count


def _plan(conductor: Conductor, cluster: Cluster, model: str, sites: WalkSites, k: int,
          edge: StreamingGraphEdge, plans: dict[int, StreamPlan]) -> StreamPlan | None:
    name = sites.walk.name
    parent = None
    if k in sites.closes[None]:  # produced by the body: by a loop delegated to one worker group, or stays here
        if not _in_delegated_loops(conductor, sites, edge.src_node):
            return None
    else:  # produced by stream j's consumer: goes on direct from where that consumer runs, if it runs on a worker
        j = next(j for j, closed in sites.closes.items() if j is not None and k in closed)
        parent = plans.get(j)
        if parent is None or not _only_in(sites, edge.src_node, j):
            return None
    calls = _stage_calls(sites, k)
    scheds = [conductor.scheduler_for(name, c.node) for c in calls]
    if not scheds or not all(isinstance(s, RemoteNodeScheduler) for s in scheds) or \
            len({tuple(s.replicas) for s in scheds}) != 1:
        return None
    if any((name, c.node) in conductor.walk_schedulers for c in calls):
        return None  # a per-walk node's state may have to move first: keep the consumer's calls here
    return StreamPlan(cluster, model, name, k, edge, scheds[0], calls, parent)


def _stage_calls(sites: WalkSites, k: int) -> list[CallSite]:
    """The call sites of stream `k`'s consumer: its per-chunk node call, or its consumer fragment's calls."""
    return [sites.stream_calls[k]] if k in sites.stream_calls else list(iter_call_sites(sites.consumers[k]))


def _only_in(sites: WalkSites, node: str, stage: int) -> bool:
    """True when every call of `node` in the walk is in stream `stage`'s consumer."""
    inside = [c for c in _stage_calls(sites, stage) if c.node == node]
    elsewhere = [c for c in iter_call_sites(sites.body) if c.node == node] + \
        [c for j in range(len(sites.walk.streams)) if j != stage for c in _stage_calls(sites, j) if c.node == node]
    return bool(inside) and not elsewhere


def _in_delegated_loops(conductor: Conductor, sites: WalkSites, node: str) -> bool:
    """True when every call of `node` in the walk is in a loop delegated to a worker (none made from here).

    Several loops, or several runs of one (the copies of a fan-out), may feed the stream at once:
    they all run on the worker that hosts `node` for the request, which sends their items on one
    session (`peer_streams.StreamLines`); each run reports how many it sent.
    """
    calls = [c for c in iter_call_sites(sites.body) if c.node == node]
    elsewhere = [c for s in (*sites.consumers.values(), *sites.stream_calls.values())
                 for c in iter_call_sites(s) if c.node == node]
    if not calls or elsewhere:
        return False
    # the body's delegated loops (its sites' paths start with 0; delegated loops never nest)
    loops = [loop for loop in sites.loops if loop.path[0] == 0 and (sites.walk.name, loop.index) in conductor.remote_loops]
    return all(any(_within(c, loop) for loop in loops) for c in calls)


def _within(call: CallSite, loop: LoopSite) -> bool:
    return call.path[: len(loop.path)] == loop.path
