"""The worker's side of a delegated loop (see `remote_loop.py` for the serving process's side).

The worker runs every iteration of the loop against its own engines and sends back only what the
walk makes visible while it runs (`LoopValues`), then the env names the loop changed (`LoopDone`).
A stream the loop feeds whose consumer runs on another worker goes there directly (`RunLoop.streams`),
and a stream's consumer can run here too (`host_consumer`, fed by `peer_streams.InboundStream`),
itself sending the streams it produces on to their consumers' workers (`RunConsumer.streams`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mstar_core.cluster.peer_streams import InboundStream, StreamLines, StreamSender, wait_for_credits
from mstar_core.cluster.remote_values import error_fields, from_wire, to_wire
from mstar_core.graph.graph import Graph
from mstar_core.graph.walk import NodeCall, Walk
from mstar_core.runtime.conductor import Conductor, RequestState, WalkFrame
from mstar_core.runtime.sites import Site, iter_call_sites
from mstar_core.runtime.streams import RequestStream
from mstar_core.wire import LoopDone, LoopValues, RunLoop
from mstar_core.wire.messages import RunConsumer


def visible_ports(graph: Graph, walk: Walk, call: NodeCall, direct: frozenset[int] = frozenset()) -> tuple[str, ...]:
    """The output ports of a call inside a walk that the caller must see as they are produced.

    Streams in `direct` go from this worker to their consumer's: the caller sees their items only if emitted.
    """
    node = graph.nodes[call.node]
    streamed = {e.src_output for k, e in enumerate(walk.streams) if e.src_node == call.node and k not in direct}
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

    def _frame(self, walk: Walk, body: Site, senders: dict[int, StreamSender] | None = None) -> WalkFrame:
        """A frame for running `body` here: the streams its nodes feed (sent on directly, or counted for priorities)."""
        frame = WalkFrame(walk, set())
        # streams not sent from here are kept only to measure the request's progress for priorities (their
        # chunks are formed, and consumed, where their consumer runs, from the forwarded values)
        nodes = {c.node for c in iter_call_sites(body)}
        for k, edge in enumerate(walk.streams):
            if senders and k in senders:
                frame.streams.setdefault(edge.src_node, []).append(senders[k])
            elif edge.src_node in nodes and edge.priority is not None:
                frame.streams.setdefault(edge.src_node, []).append(RequestStream(edge, accounting=True))
        return frame

    @staticmethod
    def _forward(graph: Graph, walk: Walk, body: Site, direct: frozenset[int] = frozenset()) -> dict:
        forward = {}
        for i, call in enumerate(iter_call_sites(body)):
            ports = visible_ports(graph, walk, call.call, direct)
            if ports:
                forward[call.path] = (i, ports)
        return forward

    async def host(self, msg: RunLoop, send: Callable[[Any], Any], lines: StreamLines | None = None) -> LoopDone:
        """Run the loop a `RunLoop` names; returns the `LoopDone` to answer with."""
        sites = self.sites[msg.walk]
        walk = sites.walk
        loop = sites.loops[msg.loop]
        try:
            senders = _senders(msg, walk, lines)
        except (KeyError, ValueError, TypeError, IndexError, RuntimeError) as exc:
            return LoopDone(request_id=msg.request_id, loop=msg.loop, branch=msg.branch, **error_fields(exc))
        frame = self._frame(walk, loop.body, senders)
        env = from_wire(msg.env)
        before = dict(env)
        state = _LoopState(msg.request_id, msg.loop, msg.branch,
                           self._forward(self.graph, walk, loop.body, frozenset(senders)), send)
        state.arrival = msg.arrival  # the serving process's: its calls queue here by the request's age, not the loop's
        state.priority = msg.priority  # and by its class (a Batch API line's background)
        _hold_to_credits(state, senders)
        try:
            await self.run_loop(state, frame, loop, env)
        except Exception as exc:
            return LoopDone(request_id=msg.request_id, loop=msg.loop, branch=msg.branch,
                            node=getattr(exc, "node", None), **error_fields(exc))
        changed = {k: v for k, v in env.items() if k not in before or before[k] is not v}
        return LoopDone(request_id=msg.request_id, loop=msg.loop, branch=msg.branch, env=to_wire(changed),
                        streamed={str(k): s.sent for k, s in senders.items()})

    async def host_consumer(self, msg: RunConsumer, send: Callable[[Any], Any], inbound: InboundStream,
                            lines: StreamLines | None = None) -> LoopDone:
        """Run the consumer of the stream a `RunConsumer` names, on chunks this worker's policy forms from `inbound`.

        A per-chunk consumer forwards every call's outputs (the caller collects them as lists); a
        consumer fragment forwards what the walk makes visible, then the env names it changed.
        Streams it produces in turn go straight to their consumer's worker when `msg.streams` routes them.
        """
        sites = self.sites[msg.walk]
        walk = sites.walk
        edge = walk.streams[msg.stream]
        stream = inbound.stream
        env = from_wire(msg.env)
        before = dict(env)
        senders: dict[int, StreamSender] = {}
        try:
            senders = _senders(msg, walk, lines)
            if edge.consumer is None:
                site = sites.stream_calls[msg.stream]
                frame = self._frame(walk, site, senders)
                state = _LoopState(msg.request_id, msg.loop, msg.branch, {}, send)
                state.arrival, state.priority = msg.arrival, msg.priority
                _hold_to_credits(state, senders)
                ports = self.graph.nodes[site.node].outputs
                while (chunk := await stream.next_chunk()) is not None:
                    outputs = await self._invoke(state, frame, site, env, {edge.dst_input: chunk})
                    send(LoopValues(request_id=msg.request_id, loop=msg.loop, call=0, branch=msg.branch,
                                    outputs=to_wire({p: outputs[p] for p in ports if p in outputs})))
                    self._feed(frame, site.node, outputs)
                changed = {}
            else:
                body = sites.consumers[msg.stream]
                state = _LoopState(msg.request_id, msg.loop, msg.branch,
                                   self._forward(self.graph, walk, body, frozenset(senders)), send)
                state.arrival, state.priority = msg.arrival, msg.priority
                _hold_to_credits(state, senders)
                await self._step(state, self._frame(walk, body, senders).fragment({edge.into: stream}), body, env)
                stream.finish_reading()
                changed = {k: v for k, v in env.items()
                           if k != edge.into and (k not in before or before[k] is not v)}
            if inbound.error is not None:
                raise inbound.error
        except Exception as exc:
            return LoopDone(request_id=msg.request_id, loop=msg.loop, branch=msg.branch,
                            node=getattr(exc, "node", None), **error_fields(exc))
        return LoopDone(request_id=msg.request_id, loop=msg.loop, branch=msg.branch, env=to_wire(changed),
                        streamed={str(k): s.sent for k, s in senders.items()})


def _hold_to_credits(state: RequestState, senders: dict[int, StreamSender]) -> None:
    """Before each node call the run waits until the streams it sends worker to worker have room (backpressure)."""
    if senders:
        state.credit = lambda: wait_for_credits(senders)


def _senders(msg: RunLoop | RunConsumer, walk: Walk, lines: StreamLines | None) -> dict[int, StreamSender]:
    """This run's sending ends of the streams `msg` routes worker to worker (`streams`: index -> route)."""
    if msg.streams and lines is None:
        raise RuntimeError("this worker has no peer mailbox to send its streams from")
    return {int(k): StreamSender(walk.streams[int(k)], int(k), msg.request_id, route, lines)
            for k, route in msg.streams.items()}
