"""The worker's side of a delegated loop (see `remote_loop.py` for the serving process's side).

The worker runs every iteration of the loop against its own engines and sends back only what the
walk makes visible while it runs (`LoopValues`), then the env names the loop changed (`LoopDone`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mstar_core.graph.graph import Graph
from mstar_core.graph.walk import NodeCall, Walk, iter_calls, iter_loops
from mstar_core.runtime.conductor import Conductor, RequestState, WalkFrame
from mstar_core.runtime.remote_values import error_fields, from_wire, to_wire
from mstar_core.wire import LoopDone, LoopValues, RunLoop


def visible_ports(graph: Graph, walk: Walk, call: NodeCall) -> tuple[str, ...]:
    """The output ports of a call inside a walk that the caller must see as they are produced."""
    node = graph.nodes[call.node]
    streamed = {e.src_output for e in walk.streams if e.src_node == call.node}
    return tuple(p for p in node.outputs if call.env_output(p) in walk.emit or p in streamed)


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
