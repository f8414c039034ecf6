"""Loops run where their nodes live: a loop whose nodes all sit on one worker runs on that worker.

This is the serving process's side; the worker's side is `loop_host.py`.

Without this, a decode `DynamicLoop` on a remote LM costs one control-plane round trip per token.
With it, the serving process sends the loop once (`RunLoop`, with the request's env), the worker
runs every iteration against its own engines, and sends back only what the walk makes visible
while it runs (`LoopValues`: emitted values and streaming-edge sources, in order) and, at the end,
the env names the loop changed (`LoopDone`). The serving process replays those values through the
same `Conductor.after_call` a local call uses, so emission and streaming edges behave identically.
"""

from __future__ import annotations

from typing import Any

from mstar_core.cluster.cluster import Cluster, RemoteNodeScheduler
from mstar_core.cluster.remote_values import to_wire
from mstar_core.errors import RequestError
from mstar_core.graph.walk import Assign, Walk, iter_leaves
from mstar_core.runtime.conductor import Conductor, RequestState, WalkFrame
from mstar_core.runtime.sites import LoopSite, iter_call_sites
from mstar_core.wire import RunLoop, WireError


class RemoteLoop:
    """Runs one loop of one walk on the worker replica that serves the request."""

    def __init__(self, cluster: Cluster, model: str, walk: Walk, loop: LoopSite, scheduler: RemoteNodeScheduler):
        self.cluster = cluster
        self.model = model
        self.walk = walk
        self.index = loop.index
        self.calls = list(iter_call_sites(loop.body))
        self.nodes = {c.node for c in self.calls}
        self.scheduler = scheduler
        # the loop's renames: the worker reports the names it changed, not those a move dropped
        self.moves = [a for a in iter_leaves(loop.spec.body) if isinstance(a, Assign) and a.move]

    async def run(self, conductor: Conductor, state: RequestState, frame: WalkFrame, loop: LoopSite, env: dict) -> None:
        for node in self.nodes:  # state of per-walk nodes moves here before the loop starts
            await conductor.hold(state, node, conductor.scheduler_for(self.walk.name, node))
        try:
            # a consumer fragment's last stream chunk stays here: the loop does not read it (see `delegate_loops`)
            sent = {k: v for k, v in env.items() if k not in frame.takes} if frame.takes else env
            # streams this loop feeds whose consumer is on another worker: it sends their items there itself
            routes = {k: r for k, r in frame.routes.items() if r.edge.src_node in self.nodes}
            msg = RunLoop(request_id=state.request_id, model=self.model, walk=self.walk.name, loop=self.index,
                          env=to_wire(sent), branch=frame.branch_key,
                          streams={str(k): r.route() for k, r in routes.items()}, arrival=state.arrival,
                          priority=state.priority)
            worker = self.scheduler.replica_for(state.request_id)

            def on_values(call: int, outputs: dict[str, Any]) -> None:
                site = self.calls[call]
                conductor.after_call(state, frame, site.call, outputs, env, site)

            delta, streamed = await self.cluster.run_loop(worker, msg, on_values)
        except WireError as exc:
            if routes:  # their consumer waits on its worker for items only this loop's worker can send
                raise RequestError(f"request {state.request_id}: the env of walk '{self.walk.name}' cannot be sent "
                                   f"to its worker: {exc}", status=400) from None
            # something in the env cannot travel: run the loop from here, one call at a time
            await conductor.run_loop(state, frame, loop, env)
            return
        for k, count in streamed.items():
            routes[int(k)].sent += int(count)
        env.update(delta)
        env.pop(loop.spec.index_name, None)
        for move in self.moves:
            if any(dst in delta for dst in move.names):  # it ran: its sources left the env, unless made again
                for src in set(move.names.values()) - set(move.names) - set(delta):
                    env.pop(src, None)


def delegate_loops(conductor: Conductor, cluster: Cluster, model: str) -> int:
    """Mark every outermost loop whose nodes all live on one worker group for delegation; returns the count.

    Loops are marked per position in their walk (a loop object shared by two walks is decided per
    walk), fan-out branches' and consumer fragments' loops too; a loop that takes chunks from a
    stream stays here, where its stream is (the worker would need each chunk sent after it).
    """
    count = 0
    for sites in conductor.sites.values():
        walk = sites.walk
        covered: set[int] = set()
        for loop in sites.loops:
            if loop.index in covered or loop.reads:
                continue
            nodes = {c.node for c in iter_call_sites(loop.body)}
            scheds = [conductor.scheduler_for(walk.name, n) for n in nodes]
            if scheds and all(isinstance(s, RemoteNodeScheduler) for s in scheds) and \
                    len({tuple(s.replicas) for s in scheds}) == 1:
                conductor.remote_loops[walk.name, loop.index] = RemoteLoop(cluster, model, walk, loop, scheds[0])
                covered.update(inner.index for inner in sites.loops if inner.path[: len(loop.path)] == loop.path)
                count += 1
    return count
