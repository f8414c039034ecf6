"""A worker process: joins a coordinator, hosts engines for the nodes placed on it, runs their steps.

    MSTAR_SECRET=... python -m mstar_core.cluster.worker --join tcp://HOST:PORT --name NAME

The control plane is one ZeroMQ DEALER socket carrying wire-codec messages (typed JSON header,
tensors as raw frames; no pickle). Invocations are batched by the same `NodeScheduler` as in the
serving process, on this process's own device thread. Big tensor frames travel through the
transport the placement names (the Welcome says which; looked up in the plugin registry: `cluster/links.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import zmq
import zmq.asyncio

from mstar_core.checkpoint.partial import node_module, release_unhosted, resident_parameters
from mstar_core.cluster.links import PeerMailbox, open_link
from mstar_core.cluster.loop_host import LoopHostConductor
from mstar_core.cluster.peer_streams import InboundStream, StreamLines
from mstar_core.cluster.rank_follower import RankFollower, join_rank_group
from mstar_core.cluster.refusals import RefusalLog
from mstar_core.cluster.remote_values import error_fields, from_wire, to_wire
from mstar_core.cluster.sealed import log_send_failure, send_sealed
from mstar_core.model import LoadOptions
from mstar_core.plugins.manager import default_registry
from mstar_core.runtime.engine import EngineContext, Invocation, active_limit, build_order, call_order
from mstar_core.runtime.host_memory import keep_freed_memory
from mstar_core.runtime.rank_steps import RankGroup
from mstar_core.runtime.scheduler import NodeScheduler
from mstar_core.wire import (
    ErrorReport,
    Heartbeat,
    InvokeNode,
    LoadModel,
    LoopDone,
    ModelLoaded,
    NodeResult,
    Release,
    RunLoop,
    Shutdown,
    WireError,
    decode,
    encode,
)
from mstar_core.wire.auth import SECRET_ENV, make_hello, secret_from_env, verify_welcome
from mstar_core.wire.batch import join_messages
from mstar_core.wire.curve import client_keys, needs_encryption
from mstar_core.wire.messages import RunConsumer, StreamEnd
from mstar_core.wire.session import Channel

log = logging.getLogger("mstar.worker")

#: How long an import waits for the state a peer worker sends it directly.
MOVE_TIMEOUT_S = 60.0


class Worker:
    """One worker's state: its socket, its engines keyed 'model/node', its device thread."""

    def __init__(self, name: str, join: str, secret: bytes, parent_pid: int | None = None,
                 encrypt: bool | None = None):
        self.name = name
        #: CURVE on the control link: by default whenever `join` is not a loopback or IPC address
        self.encrypt = needs_encryption(join) if encrypt is None else encrypt
        self.link = None  # this end of the worker link, over the transport the Welcome names
        self.join = join
        self.secret = secret
        self.parent_pid = parent_pid
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        keep_freed_memory()  # the device thread's forwards reuse their pages instead of faulting them in again
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mstar-device-{name}")
        self.schedulers: dict[str, NodeScheduler] = {}
        self.heartbeat_interval = 0.5
        self._stop = asyncio.Event()
        self._pending: set[asyncio.Task] = set()
        self.hosts: dict[str, LoopHostConductor] = {}  # model -> conductor for loops delegated here
        #: what this process holds: {"parameters", "parameter_bytes"} overall and per 'model/node' (fixed once loaded)
        self.resident: dict[str, dict[str, int]] = {}
        self.graphs: dict = {}  # model -> its graph (modules of nodes hosted elsewhere on the meta device)
        self._loops: dict[str, set[asyncio.Task]] = {}
        self._outbox: list[list] | None = None  # messages `send_soon` queued this turn of the event loop
        self.channel: Channel | None = None  # the authenticated session, once welcomed
        self.refusals = RefusalLog(log)
        self.mailbox: PeerMailbox | None = None  # state moved here directly by other workers (per-walk KV moves)
        self.lines: StreamLines | None = None  # the streams this worker's runs send to other workers, per request
        #: streams whose consumer runs here, fed by their producer's worker: (request, stream, branch) -> end
        self._inbound: dict[tuple[str, int, str], InboundStream] = {}
        self.rank_group: tuple | None = None  # (split, channel) once this worker joined a tensor-parallel group
        self.follower: RankFollower | None = None  # ranks 1..N-1: runs rank 0's steps on this rank's engines
        self.rejoin = False  # set when the server declared this (hand-joined) worker lost: run again, join anew

    def send_soon(self, msg) -> None:
        """Send without waiting, strictly after everything sent before it (loop values, then done).

        The message is encoded here, not in the background: a value that cannot travel raises in
        the caller (a delegated loop then fails its request) instead of vanishing unsent. It goes
        out at the end of this turn of the event loop, with every other message sent this way in
        the meantime, as one sealed message (`wire.batch`): a decode step of N requests costs the
        control socket one message, not N.
        """
        frames = self._encode(msg)
        if self.channel is None:  # not welcomed yet (nothing sends this way before): no session to seal with
            self.sock.send_multipart(frames, copy=False).add_done_callback(_SEND_FAILED)
            return
        if self._outbox is None:
            self._outbox = []
            asyncio.get_running_loop().call_soon(self._flush_outbox)
        self._outbox.extend(self._packed(frames))

    async def send(self, msg) -> None:
        await self._send_frames(self._encode(msg))

    def _encode(self, msg) -> list:
        # device tensors stay on the device when the link moves them itself (NCCL)
        return encode(msg, keep_device=self.link is not None and self.channel is not None and self.link.keep_device)

    def _packed(self, frames: list) -> list[list]:
        """A message as the link sends it, after what the link has for the server's end (e.g. shm slots released)."""
        if self.link is None:
            return [frames]
        packed = self.link.pack(frames)
        ctl = self.link.control()
        return [packed] if ctl is None else [ctl, packed]

    def _flush_outbox(self) -> None:
        pending, self._outbox = self._outbox, None
        if pending and self.channel is not None:
            send_sealed(self.sock, self.channel, join_messages(pending), unawaited=TO_SERVER)

    def _send_frames(self, frames: list) -> asyncio.Future:
        # sealing and handing to the socket happen in one go: sequence numbers go out in order
        if self.channel is None:  # only the Hello goes out before the session exists
            return self.sock.send_multipart(frames, copy=False)
        self._flush_outbox()  # what `send_soon` queued goes first
        return send_sealed(self.sock, self.channel, join_messages(self._packed(frames)))

    async def recv(self, timeout: float | None = None):
        """The next message from the coordinator; anything not sealed for our session is dropped (and logged)."""
        while True:
            frames = [f.buffer for f in await asyncio.wait_for(self.sock.recv_multipart(copy=False), timeout)]
            try:
                if self.channel is not None:
                    frames = self.channel.open(frames)
                if self.link is not None and self.channel is not None:
                    frames = self.link.unpack(frames)
                    if frames is None:
                        continue  # a message for the link itself (e.g. shm slots released, segments mapped)
                    if isinstance(frames, concurrent.futures.Future):  # big frames still arriving over the link
                        frames = await asyncio.wrap_future(frames)
                return decode(frames)
            except WireError as exc:  # AuthError included
                if self.channel is None:
                    raise
                self.refusals.refuse("recv", "worker %s: dropped a message from the coordinator: %s", self.name, exc)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        registry = await loop.run_in_executor(self.executor, default_registry)  # imports, before any beat is due
        if self.encrypt:
            client_keys(self.sock, self.secret)
        self.sock.connect(self.join)
        hello = make_hello(self.secret, self.name)
        await self.send(hello)
        try:
            welcome = await self.recv(timeout=float(os.environ.get("MSTAR_JOIN_TIMEOUT", "15")))
        except TimeoutError:
            how = "encrypted" if self.encrypt else "unencrypted"
            raise SystemExit(f"worker {self.name}: no answer from {self.join} ({how}; wrong address, wrong "
                             f"{SECRET_ENV}, or a server that {'does not encrypt' if self.encrypt else 'encrypts'} "
                             f"(--encrypt)?)") from None
        verify_welcome(self.secret, hello, welcome)
        self.link = open_link(registry, welcome.transport, "worker")
        self.link.peer_joined({"control": self.join})
        self.link.on_failure = lambda why: loop.call_soon_threadsafe(self._link_failed, why)
        self.channel = Channel.for_worker(self.secret, hello.nonce, welcome.session)
        self.heartbeat_interval = welcome.heartbeat_interval
        host = self._peer_host()
        # CURVE exactly when the mailbox is reachable from other hosts: senders decide by its address the same way
        self.mailbox = PeerMailbox(self.secret, host, needs_encryption(f"tcp://{host}:0"))
        self.lines = StreamLines(self.mailbox)
        beat = asyncio.ensure_future(self._heartbeat())
        try:
            while not self._stop.is_set():
                msg = await self.recv()
                if isinstance(msg, Shutdown):
                    # a worker joined by hand has nobody to start it again: declared lost, it joins again itself
                    self.rejoin = msg.rejoin and self.parent_pid is None
                    if msg.reason:
                        log.warning("worker %s: %s: %s", self.name, "rejoining" if self.rejoin else "leaving",
                                    msg.reason)
                    break
                try:
                    self._dispatch(msg)
                except Exception:  # one bad message fails what it carried, never the worker
                    log.exception("worker %s: could not handle a %s", self.name, type(msg).__name__)
        finally:
            beat.cancel()
            for sched in self.schedulers.values():
                await sched.close()
            self.sock.close(0)
            self.ctx.term()
            self.executor.shutdown(wait=False, cancel_futures=True)
            if self.link is not None:
                self.link.close()
            if self.mailbox is not None:
                self.mailbox.close()

    def _peer_host(self) -> str:
        """Where other workers reach this one: loopback, unless it joined the server from another host."""
        if not needs_encryption(self.join):
            return "127.0.0.1"
        import socket

        host = self.join.partition("://")[2].rsplit(":", 1)[0].strip("[]")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # no packet: only picks the interface on the route to the server
            return s.getsockname()[0]

    def _link_failed(self, why: str) -> None:
        # nothing more reaches us over the link and a group's threads cannot be unblocked: leave, be replaced
        log.error("worker %s: its %s link broke (%s); exiting so the server replaces it", self.name,
                  self.link.name if self.link else "?", why)
        os._exit(3)

    def _dispatch(self, msg) -> None:
        if isinstance(msg, InvokeNode):
            self._invoke(msg)
        elif isinstance(msg, RunLoop):
            task = asyncio.ensure_future(self._run_loop(msg))
            self._loops.setdefault(msg.request_id, set()).add(task)
            task.add_done_callback(lambda t, rid=msg.request_id: self._loops.get(rid, set()).discard(t))
        elif isinstance(msg, RunConsumer):
            self._start_consumer(msg)
        elif isinstance(msg, StreamEnd):
            inbound = self._inbound.get((msg.request_id, msg.stream, msg.branch))
            if inbound is not None:
                inbound.end(msg.items)
        elif isinstance(msg, Release):
            for task in self._loops.pop(msg.request_id, set()):
                task.cancel()
            for key in [k for k in self._inbound if k[0] == msg.request_id]:
                self._drop_inbound(key)
            if self.lines is not None:
                self.lines.release(msg.request_id)
            for sched in self.schedulers.values():
                sched.release(msg.request_id)
        elif isinstance(msg, LoadModel):
            task = asyncio.ensure_future(self._load(msg))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
        else:
            self.refusals.refuse("unexpected", "worker %s: the coordinator sent a %s; dropped", self.name,
                                 type(msg).__name__)

    async def _heartbeat(self) -> None:
        seq = 0
        while True:
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                log.warning("worker %s: serving process %s is gone; exiting", self.name, self.parent_pid)
                os._exit(0)
            seq += 1
            load = {}
            engines = {key: sched.engine for key, sched in self.schedulers.items()}
            engines.update(self.follower.engines if self.follower is not None else {})
            for key, engine in engines.items():
                try:
                    load[key] = {**engine.stats(), **self.resident.get(key, {})}
                except Exception:  # gauges are optional; the beat is not
                    load[key] = dict(self.resident.get(key, {}))
            if "process" in self.resident:
                load["process"] = self.resident["process"]
            if self.link is not None:
                load["link"] = {"transport": self.link.name, **self.link.stats.as_dict()}
            if self.mailbox is not None:
                # stream_lines: the sending sessions this worker's runs hold open (until their requests' release)
                load["peer"] = {**self.mailbox.stats(), "stream_lines": self.lines.open_count() if self.lines else 0}
            try:
                await self.send(Heartbeat(worker=self.name, seq=seq, time=time.time(), load=load))
            except WireError:  # a gauge that cannot travel: beat without gauges
                await self.send(Heartbeat(worker=self.name, seq=seq, time=time.time()))
            await asyncio.sleep(self.heartbeat_interval)

    async def _load(self, msg: LoadModel) -> None:
        loop = asyncio.get_running_loop()
        try:
            registry = await loop.run_in_executor(self.executor, default_registry)  # imports: off the beating loop
            spec = registry.models.get(msg.model)
            if msg.tensor_parallel and self.rank_group is None:  # every rank of the group meets here once
                self.rank_group = await loop.run_in_executor(self.executor, join_rank_group, msg.tensor_parallel,
                                                             msg.device)
                if self.rank_group[0].rank > 0:
                    self.follower = RankFollower(self.name, self.rank_group[1])
            split = self.rank_group[0] if msg.tensor_parallel and self.rank_group else None
            options = LoadOptions(checkpoint=msg.checkpoint, preset=msg.preset, device=msg.device, dtype=msg.dtype,
                                  nodes=tuple(msg.nodes), tensor_parallel=split)
            loaded = await loop.run_in_executor(self.executor, spec.load, options)
            await loop.run_in_executor(self.executor, release_unhosted, loaded.graph, msg.nodes)
            self.graphs[msg.model] = loaded.graph
            device = torch.device(msg.device)
            built = {}
            for node_name in build_order(loaded.graph, msg.nodes):
                node = loaded.graph.nodes[node_name]
                settings = {**loaded.engine_settings.get(node_name, {}), **msg.settings.get(node_name, {})}
                settings.pop("own_thread", None)  # a worker's nodes share its one device thread
                limit = active_limit(node_name, settings.pop("max_active_requests", None))
                order = call_order(node_name, settings.pop("call_order", None))
                engine_cls = registry.engines.get(node.engine)
                key = f"{msg.model}/{node_name}"
                ranks = RankGroup(split, self.rank_group[1], key) if split is not None else None
                context = EngineContext(self.name, device, settings, registry, peers=dict(built), rank_group=ranks)
                module = node.module() if node.module is not None else None
                built[node_name] = engine = await loop.run_in_executor(self.executor, engine_cls, node, module, context)
                engine.max_active_requests, engine.call_order = limit, order
                if self.follower is not None:
                    self.follower.add(key, engine)  # steps come from rank 0, not from a scheduler here
                else:
                    self.schedulers[key] = NodeScheduler(engine, self.executor)
            self._count_resident()
            if self.follower is not None:
                self.follower.start()
            else:
                local = {n: self.schedulers[f"{msg.model}/{n}"] for n in msg.nodes}
                self.hosts[msg.model] = LoopHostConductor(loaded.graph, local)
            await self.send(ModelLoaded(worker=self.name, model=msg.model, nodes=list(msg.nodes)))
        except Exception as exc:
            log.exception("worker %s failed to load %s", self.name, msg.model)
            await self.send(ErrorReport(worker=self.name, message=f"loading {msg.model}: {exc}", error_type=type(exc).__name__))

    def _count_resident(self) -> None:
        resident = {}
        for model, graph in self.graphs.items():
            for name, node in graph.nodes.items():
                key = f"{model}/{name}"
                if key in self.schedulers or (self.follower is not None and key in self.follower.engines):
                    resident[f"{model}/{name}"] = resident_parameters([node_module(node)])
        every = [node_module(node) for graph in self.graphs.values() for node in graph.nodes.values()]
        resident["process"] = resident_parameters(every)
        self.resident = resident

    async def _run_loop(self, msg: RunLoop) -> None:
        host = self.hosts.get(msg.model)
        if host is None:
            done = LoopDone(request_id=msg.request_id, loop=msg.loop, branch=msg.branch,
                            error=f"worker {self.name} has no model '{msg.model}'", error_type="KeyError")
        else:
            try:
                done = await host.host(msg, self.send_soon, self.lines)
            except Exception as exc:  # e.g. an env value that does not decode: fail the request, answer anyway
                done = LoopDone(request_id=msg.request_id, loop=msg.loop, branch=msg.branch, **error_fields(exc))
        try:
            self.send_soon(done)
        except WireError as exc:  # the loop's env changes cannot travel: fail the request, do not leave it waiting
            self.send_soon(LoopDone(request_id=msg.request_id, loop=msg.loop, branch=msg.branch, error=str(exc),
                                    error_type="WireError"))

    def _start_consumer(self, msg: RunConsumer) -> None:
        """Register the stream's inbound end now (its items may already be arriving), then run the consumer."""
        key = (msg.request_id, msg.stream, msg.branch)
        host = self.hosts.get(msg.model)
        try:
            if host is None:
                raise KeyError(f"worker {self.name} has no model '{msg.model}'")
            if self.mailbox is None:
                raise RuntimeError(f"worker {self.name} has no peer mailbox yet")
            if key in self._inbound:
                raise RuntimeError(f"stream {msg.stream} of request {msg.request_id} already has a consumer here")
            edge = host.sites[msg.walk].walk.streams[msg.stream]
            mailbox, session = self.mailbox, msg.session
            inbound = InboundStream(edge, session, ack=lambda taken: mailbox.ack_stream(session, taken))
            self.mailbox.accept_stream(msg.session, msg.nonce, inbound.deliver)
        except Exception as exc:
            self.send_soon(LoopDone(request_id=msg.request_id, loop=msg.loop, branch=msg.branch, **error_fields(exc)))
            return
        self._inbound[key] = inbound

        async def consume() -> None:
            try:
                done = await host.host_consumer(msg, self.send_soon, inbound, self.lines)
            finally:
                if self._inbound.get(key) is inbound:
                    self._drop_inbound(key)
            try:
                self.send_soon(done)
            except WireError as exc:  # the fragment's env changes cannot travel: fail the request, answer anyway
                self.send_soon(LoopDone(request_id=msg.request_id, loop=msg.loop, branch=msg.branch, error=str(exc),
                                        error_type="WireError"))

        task = asyncio.ensure_future(consume())
        self._loops.setdefault(msg.request_id, set()).add(task)
        task.add_done_callback(lambda t, rid=msg.request_id: self._loops.get(rid, set()).discard(t))

    def _drop_inbound(self, key: tuple[str, int, str]) -> None:
        inbound = self._inbound.pop(key)
        if self.mailbox is not None:
            self.mailbox.drop_stream(inbound.session)

    def _invoke(self, msg: InvokeNode) -> None:
        sched = self.schedulers.get(msg.node)
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
            task = asyncio.ensure_future(self._move(msg, sched, inputs, options))
            self._loops.setdefault(msg.request_id, set()).add(task)
            task.add_done_callback(lambda t, rid=msg.request_id: self._loops.get(rid, set()).discard(t))
            return
        inv = Invocation(msg.request_id, msg.node.split("/", 1)[1], inputs, options, msg.call_index, arrival=msg.arrival)
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
            if self.mailbox is None:
                raise RuntimeError(f"worker {self.name} has no peer mailbox yet")
            if to is None:  # import: wait for the exporter's sealed state
                frames = await asyncio.wait_for(self.mailbox.expect(str(session)), MOVE_TIMEOUT_S)
                sent = decode(frames)
                inputs = {**inputs, "state": from_wire(sent.outputs)["state"]}
            result = await sched.submit(Invocation(msg.request_id, node, inputs, options, msg.call_index,
                                                    arrival=msg.arrival))
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
            await self.send(NodeResult(request_id=msg.request_id, node=msg.node, call_index=msg.call_index,
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
            await self.send(NodeResult(request_id=msg.request_id, node=msg.node, call_index=msg.call_index,
                                       outputs=to_wire(future.result())))
        except WireError as exc:  # an output that cannot travel fails the call; it must not go unanswered
            await self._reply_error(msg, exc)

    async def _reply_error(self, msg: InvokeNode, exc: BaseException) -> None:
        await self.send(NodeResult(request_id=msg.request_id, node=msg.node, call_index=msg.call_index,
                                   **error_fields(exc)))


TO_SERVER = "a message to the server"  # what a failed unawaited send logs
_SEND_FAILED = log_send_failure(TO_SERVER)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="mstar worker", description="Join an M* server as a worker process.")
    parser.add_argument("--join", required=True, help="the server's control address, e.g. tcp://10.0.0.2:7100")
    parser.add_argument("--name", required=True, help="the worker name the placement file gives this worker")
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--encrypt", choices=("auto", "on", "off"), default="auto",
                        help="CURVE-encrypt the control link (auto: when --join is not loopback or IPC, as the "
                             "server does for its bind address)")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s worker[{args.name}] %(levelname)s %(message)s")
    try:
        secret = secret_from_env()
    except Exception as exc:
        print(f"mstar worker {args.name}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    torch.set_num_threads(max(1, int(os.environ.get("MSTAR_WORKER_THREADS", torch.get_num_threads()))))
    try:
        while True:  # a hand-joined worker declared lost (a network partition healed) joins again, fresh
            worker = Worker(args.name, args.join, secret, args.parent_pid,
                            encrypt={"auto": None, "on": True, "off": False}[args.encrypt])
            asyncio.run(worker.run())
            if not worker.rejoin:
                break
    except KeyboardInterrupt:
        pass
    except Exception as exc:
        print(f"mstar worker {args.name}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    if worker.rank_group is not None:  # a follower thread blocks in a collective: leave without waiting for it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
