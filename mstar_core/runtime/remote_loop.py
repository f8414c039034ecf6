"""Loops run where their nodes live: a loop whose nodes all sit on one worker runs on that worker.

Without this, a decode `DynamicLoop` on a remote LM costs one control-plane round trip per token.
With it, the serving process sends the loop once (`RunLoop`, with the request's env), the worker
runs every iteration against its own engines, and sends back only what the walk makes visible
while it runs (`LoopValues`: emitted values and streaming-edge sources, in order) and, at the end,
the env names the loop changed (`LoopDone`). The serving process replays those values through the
same `Conductor.after_call` a local call uses, so emission and streaming edges behave identically.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mstar_core.graph.graph import Graph
from mstar_core.graph.walk import DynamicLoop, Loop, NodeCall, Walk, iter_calls, iter_loops
from mstar_core.runtime.conductor import Conductor, RequestState, WalkFrame
from mstar_core.runtime.remote_values import error_fields, from_wire, to_wire
from mstar_core.wire import LoopDone, LoopValues, RunLoop, WireError

if TYPE_CHECKING:
    from mstar_core.runtime.cluster import Cluster, RemoteNodeScheduler


def visible_ports(graph: Graph, walk: Walk, call: NodeCall) -> tuple[str, ...]:
    """The output ports of a call inside a walk that the caller must see as they are produced."""
    node = graph.nodes[call.node]
    streamed = {e.src_output for e in walk.streams if e.src_node == call.node}
    return tuple(p for p in node.outputs if call.env_output(p) in walk.emit or p in streamed)


# -- serving-process side ----------------------------------------------------------------------


class RemoteLoop:
    """Runs one loop of one walk on the worker replica that serves the request."""

    def __init__(self, cluster: Cluster, model: str, walk: Walk, index: int, loop: Loop | DynamicLoop,
                 scheduler: RemoteNodeScheduler):
        self.cluster = cluster
        self.model = model
        self.walk = walk
        self.index = index
        self.calls = list(iter_calls(loop.body))
        self.nodes = {c.node for c in self.calls}
        self.scheduler = scheduler

    async def run(self, conductor: Conductor, state: RequestState, frame: WalkFrame, loop, env: dict) -> None:
        for node in self.nodes:  # state of per-walk nodes moves here before the loop starts
            await conductor.hold(state, node, conductor.scheduler_for(self.walk.name, node))
        try:
            msg = RunLoop(request_id=state.request_id, model=self.model, walk=self.walk.name, loop=self.index,
                          env=to_wire(env))
            worker = self.scheduler.replica_for(state.request_id)

            def on_values(call: int, outputs: dict[str, Any]) -> None:
                conductor.after_call(state, frame, self.calls[call], outputs, env)

            delta = await self.cluster.run_loop(worker, msg, on_values)
        except WireError:
            # something in the env cannot travel: run the loop from here, one call at a time
            await conductor.run_loop(state, frame, loop, env)
            return
        env.update(delta)
        env.pop(loop.index_name, None)


def delegate_loops(conductor: Conductor, cluster: Cluster, model: str) -> int:
    """Mark every outermost loop whose nodes all live on one worker group for delegation; returns the count."""
    from mstar_core.runtime.cluster import RemoteNodeScheduler

    count = 0
    for walk in conductor.graph.walks.values():
        covered: set[int] = set()
        for index, loop in enumerate(iter_loops(walk.body)):
            if id(loop) in covered:
                continue
            nodes = {c.node for c in iter_calls(loop.body)}
            scheds = [conductor.scheduler_for(walk.name, n) for n in nodes]
            if scheds and all(isinstance(s, RemoteNodeScheduler) for s in scheds) and \
                    len({tuple(s.replicas) for s in scheds}) == 1:
                conductor.remote_loops[id(loop)] = RemoteLoop(cluster, model, walk, index, loop, scheds[0])
                covered.update(id(inner) for inner in iter_loops(loop.body))
                count += 1
    return count


# -- worker side -------------------------------------------------------------------------------


class _LoopState(RequestState):
    __slots__ = ("forward", "loop_index", "send")

    def __init__(self, request_id: str, loop_index: int, forward: dict[int, tuple[int, tuple[str, ...]]],
                 send: Callable[[Any], Any]):
        super().__init__(request_id, emit=lambda _output: None)
        self.loop_index = loop_index
        self.forward = forward
        self.send = send


class LoopHostConductor(Conductor):
    """A worker's conductor for delegated loops: runs them locally and forwards visible values."""

    def after_call(self, state, frame, call, outputs, env) -> None:
        super().after_call(state, frame, call, outputs, env)
        if isinstance(state, _LoopState):
            entry = state.forward.get(id(call))
            if entry is not None:
                index, ports = entry
                state.send(LoopValues(request_id=state.request_id, loop=state.loop_index, call=index,
                                      outputs=to_wire({p: outputs[p] for p in ports if p in outputs})))

    async def host(self, msg: RunLoop, send: Callable[[Any], Any]) -> LoopDone:
        """Run the loop a `RunLoop` names; returns the `LoopDone` to answer with."""
        walk = self.graph.walks[msg.walk]
        loop = list(iter_loops(walk.body))[msg.loop]
        calls = list(iter_calls(loop.body))
        forward = {}
        for i, call in enumerate(calls):
            ports = visible_ports(self.graph, walk, call)
            if ports:
                forward[id(call)] = (i, ports)
        env = from_wire(msg.env)
        before = dict(env)
        state = _LoopState(msg.request_id, msg.loop, forward, send)
        try:
            await self.run_loop(state, WalkFrame(walk, set()), loop, env)
        except Exception as exc:
            return LoopDone(request_id=msg.request_id, loop=msg.loop, node=getattr(exc, "node", None),
                            **error_fields(exc))
        changed = {k: v for k, v in env.items() if k not in before or before[k] is not v}
        return LoopDone(request_id=msg.request_id, loop=msg.loop, env=to_wire(changed))
