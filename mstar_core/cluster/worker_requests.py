"""What a worker runs for requests: node calls, delegated loops, stream consumers, state moves; and their release.

Every call is answered, whatever happens: an output that cannot travel, an unknown node or a
failed move becomes an error answer for that call, never silence. Loops, consumers and moves
are tracked per request, so a Release cancels what of the request still runs here.
"""

from __future__ import annotations

import asyncio
import logging

from mstar_core.cluster.coordinator_link import CoordinatorLink
from mstar_core.cluster.hosted_engines import HostedEngines
from mstar_core.cluster.peer_mailbox import PeerMailbox
from mstar_core.cluster.peer_streams import InboundStream, StreamLines
from mstar_core.cluster.remote_values import error_fields, from_wire, to_wire
from mstar_core.runtime.engine import Invocation
from mstar_core.runtime.scheduler import NodeScheduler
from mstar_core.wire import InvokeNode, LoopDone, NodeResult, RunLoop, WireError, decode, encode
from mstar_core.wire.messages import RunConsumer, StreamEnd

log = logging.getLogger("mstar.worker")

#: How long an import waits for the state a peer worker sends it directly.
MOVE_TIMEOUT_S = 60.0


class WorkerRequests:
    """The request work in flight on this worker: its tasks per request, and the inbound ends of streams."""

    def __init__(self, name: str, engines: HostedEngines, control: CoordinatorLink, mailbox: PeerMailbox,
                 lines: StreamLines):
        self.name = name
        self.engines = engines
        self.control = control
        self.mailbox = mailbox  # state moved here directly by other workers (per-walk KV moves)
        self.lines = lines  # the streams this worker's runs send to other workers, per request
        self._tasks: dict[str, set[asyncio.Task]] = {}  # request -> its loops, consumers and moves running here
        #: streams whose consumer runs here, fed by their producer's worker: (request, stream, branch) -> end
        self._inbound: dict[tuple[str, int, str], InboundStream] = {}

    def _track(self, request_id: str, task: asyncio.Task) -> None:
        self._tasks.setdefault(request_id, set()).add(task)
        task.add_done_callback(lambda t, rid=request_id: self._tasks.get(rid, set()).discard(t))

    def release(self, request_id: str) -> None:
        """The request ended: cancel what of it runs here, drop its inbound streams and its lines."""
        for task in self._tasks.pop(request_id, set()):
            task.cancel()
        for key in [k for k in self._inbound if k[0] == request_id]:
            self._drop_inbound(key)
        self.lines.release(request_id)
        self.engines.release(request_id)

    # -- delegated loops and stream consumers ------------------------------------------------------

    def run_loop(self, msg: RunLoop) -> None:
        self._track(msg.request_id, asyncio.ensure_future(self._run_loop(msg)))

    async def _run_loop(self, msg: RunLoop) -> None:
        host = self.engines.hosts.get(msg.model)
        if host is None:
            done = LoopDone(request_id=msg.request_id, loop=msg.loop, branch=msg.branch,
                            error=f"worker {self.name} has no model '{msg.model}'", error_type="KeyError")
        else:
            try:
                done = await host.host(msg, self.control.send_soon, self.lines)
            except Exception as exc:  # e.g. an env value that does not decode: fail the request, answer anyway
                done = LoopDone(request_id=msg.request_id, loop=msg.loop, branch=msg.branch, **error_fields(exc))
        self._send_done(msg, done)

    def _send_done(self, msg: RunLoop | RunConsumer, done: LoopDone) -> None:
        try:
            self.control.send_soon(done)
        except WireError as exc:  # the loop's env changes cannot travel: fail the request, do not leave it waiting
            self.control.send_soon(LoopDone(request_id=msg.request_id, loop=msg.loop, branch=msg.branch,
                                            error=str(exc), error_type="WireError"))

    def start_consumer(self, msg: RunConsumer) -> None:
        """Register the stream's inbound end now (its items may already be arriving), then run the consumer."""
        key = (msg.request_id, msg.stream, msg.branch)
        host = self.engines.hosts.get(msg.model)
        try:
            if host is None:
                raise KeyError(f"worker {self.name} has no model '{msg.model}'")
            if key in self._inbound:
                raise RuntimeError(f"stream {msg.stream} of request {msg.request_id} already has a consumer here")
            edge = host.sites[msg.walk].walk.streams[msg.stream]
            mailbox, session = self.mailbox, msg.session
            inbound = InboundStream(edge, session, ack=lambda taken: mailbox.ack_stream(session, taken))
            self.mailbox.accept_stream(msg.session, msg.nonce, inbound.deliver)
        except Exception as exc:
            self.control.send_soon(LoopDone(request_id=msg.request_id, loop=msg.loop, branch=msg.branch,
                                            **error_fields(exc)))
            return
        self._inbound[key] = inbound

        async def consume() -> None:
            try:
                done = await host.host_consumer(msg, self.control.send_soon, inbound, self.lines)
            finally:
                if self._inbound.get(key) is inbound:
                    self._drop_inbound(key)
            self._send_done(msg, done)

        self._track(msg.request_id, asyncio.ensure_future(consume()))

    def stream_end(self, msg: StreamEnd) -> None:
        inbound = self._inbound.get((msg.request_id, msg.stream, msg.branch))
        if inbound is not None:
            inbound.end(msg.items)

    def _drop_inbound(self, key: tuple[str, int, str]) -> None:
        inbound = self._inbound.pop(key)
        self.mailbox.drop_stream(inbound.session)

    # -- node calls and state moves ------------------------------------------------------------------

    def invoke(self, msg: InvokeNode) -> None:
        sched = self.engines.schedulers.get(msg.node)
        if sched is None:
            asyncio.ensure_future(self._reply_error(msg, KeyError(f"worker {self.name} hosts no node '{msg.node}'")))
            return
        try:
            inputs, options = from_wire(msg.inputs), from_wire(msg.options)
        except Exception as exc:  # e.g. sampling parameters that do not validate: that call fails
            asyncio.ensure_future(self._reply_error(msg, exc))
            return
        if "peer_session" in options:  # a per-walk state move straight between workers
            # tracked like a delegated loop, so a Release cancels a move still waiting for its state
            # (imported after the release, that state's pages would never be freed)
            self._track(msg.request_id, asyncio.ensure_future(self._move(msg, sched, inputs, options)))
            return
        inv = Invocation(msg.request_id, msg.node.split("/", 1)[1], inputs, options, msg.call_index,
                         priority=msg.priority, arrival=msg.arrival)
        future = sched.submit(inv)
        future.add_done_callback(lambda f, m=msg: asyncio.ensure_future(self._reply(m, f)))

    async def _move(self, msg: InvokeNode, sched: NodeScheduler, inputs: dict, options: dict) -> None:
        """Export the request's state straight to a peer worker, or import what a peer sent (see PeerMailbox).

        The exporting side answers the server with no outputs: the state itself never passes through it.
        """
        options = dict(options)
        nonce, session, to = options.pop("peer_nonce", ""), options.pop("peer_session"), options.pop("peer_to", None)
        node = msg.node.split("/", 1)[1]
        try:
            if to is None:  # import: wait for the exporter's sealed state
                frames = await asyncio.wait_for(self.mailbox.expect(str(session)), MOVE_TIMEOUT_S)
                sent = decode(frames)
                inputs = {**inputs, "state": from_wire(sent.outputs)["state"]}
            result = await sched.submit(Invocation(msg.request_id, node, inputs, options, msg.call_index,
                                                    priority=msg.priority, arrival=msg.arrival))
            if to is not None:
                state = NodeResult(request_id=msg.request_id, node=msg.node, call_index=msg.call_index,
                                   outputs=to_wire({"state": result["state"]}))
                await self.mailbox.send(str(to), str(nonce), str(session), encode(state))
                result = {}
        except asyncio.CancelledError:
            return
        except Exception as exc:
            if isinstance(exc, TimeoutError):
                exc = TimeoutError(f"the state of request {msg.request_id} did not arrive from its previous worker "
                                   f"within {MOVE_TIMEOUT_S:.0f}s")
            await self._reply_error(msg, exc)
            return
        try:
            await self.control.send(NodeResult(request_id=msg.request_id, node=msg.node, call_index=msg.call_index,
                                               outputs=to_wire(result)))
        except WireError as exc:
            await self._reply_error(msg, exc)

    async def _reply(self, msg: InvokeNode, future: asyncio.Future) -> None:
        if future.cancelled():
            return  # released: nobody waits for it
        exc = future.exception()
        if exc is not None:
            await self._reply_error(msg, exc)
            return
        try:
            await self.control.send(NodeResult(request_id=msg.request_id, node=msg.node, call_index=msg.call_index,
                                               outputs=to_wire(future.result())))
        except WireError as exc:  # an output that cannot travel fails the call; it must not go unanswered
            await self._reply_error(msg, exc)

    async def _reply_error(self, msg: InvokeNode, exc: BaseException) -> None:
        await self.control.send(NodeResult(request_id=msg.request_id, node=msg.node, call_index=msg.call_index,
                                           **error_fields(exc)))
