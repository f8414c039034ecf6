"""The worker's side of a delegated loop (see `remote_loop.py` for the serving process's side).

The worker runs every iteration of the loop against its own engines and sends back only what the
walk makes visible while it runs (`LoopValues`), then the env names the loop changed (`LoopDone`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mstar_core.graph.graph import Graph
from mstar_core.graph.walk import NodeCall, Walk
from mstar_core.runtime.conductor import Conductor, RequestState, WalkFrame
from mstar_core.runtime.remote_values import error_fields, from_wire, to_wire
from mstar_core.runtime.sites import iter_call_sites
from mstar_core.runtime.streams import RequestStream
from mstar_core.wire import LoopDone, LoopValues, RunLoop


def visible_ports(graph: Graph, walk: Walk, call: NodeCall) -> tuple[str, ...]:
    """The output ports of a call inside a walk that the caller must see as they are produced."""
    node = graph.nodes[call.node]
    streamed = {e.src_output for e in walk.streams if e.src_node == call.node}
    return tuple(p for p in node.outputs if call.env_output(p) in walk.emit or p in streamed)


class _LoopState(RequestState):
    __slots__ = ("branch", "forward", "loop_index", "send")

    def __init__(self, request_id: str, loop_index: int, branch: str,
                 forward: dict[tuple[int, ...], tuple[int, tuple[str, ...]]], send: Callable[[Any], Any]):
        super().__init__(request_id, emit=lambda _output: None)
        self.loop_index = loop_index
        self.branch = branch
        self.forward = forward
        self.send = send


class LoopHostConductor(Conductor):
    """A worker's conductor for delegated loops: runs them locally and forwards visible values."""

    def after_call(self, state, frame, call, outputs, env, site=None) -> None:
        super().after_call(state, frame, call, outputs, env, site)
        if isinstance(state, _LoopState) and site is not None:
            entry = state.forward.get(site.path)
            if entry is not None:
                index, ports = entry
                state.send(LoopValues(request_id=state.request_id, loop=state.loop_index, call=index,
                                      outputs=to_wire({p: outputs[p] for p in ports if p in outputs}),
                                      branch=state.branch))

    async def host(self, msg: RunLoop, send: Callable[[Any], Any]) -> LoopDone:
        """Run the loop a `RunLoop` names; returns the `LoopDone` to answer with."""
        sites = self.sites[msg.walk]
        walk = sites.walk
        loop = sites.loops[msg.loop]
        forward = {}
        for i, call in enumerate(iter_call_sites(loop.body)):
            ports = visible_ports(self.graph, walk, call.call)
            if ports:
                forward[call.path] = (i, ports)
        frame = WalkFrame(walk, set())
        # the streams this loop feeds, kept here only to measure the request's progress for priorities
        # (their chunks are formed again, and consumed, in the serving process from the forwarded values)
        nodes = {c.node for c in iter_call_sites(loop.body)}
        for edge in walk.streams:
            if edge.src_node in nodes and edge.priority is not None:
                frame.streams.setdefault(edge.src_node, []).append(RequestStream(edge, accounting=True))
        env = from_wire(msg.env)
        before = dict(env)
        state = _LoopState(msg.request_id, msg.loop, msg.branch, forward, send)
        try:
            await self.run_loop(state, frame, loop, env)
        except Exception as exc:
            return LoopDone(request_id=msg.request_id, loop=msg.loop, branch=msg.branch,
                            node=getattr(exc, "node", None), **error_fields(exc))
        changed = {k: v for k, v in env.items() if k not in before or before[k] is not v}
        return LoopDone(request_id=msg.request_id, loop=msg.loop, branch=msg.branch, env=to_wire(changed))
