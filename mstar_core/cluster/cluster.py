"""The coordinator side of multi-process serving: the control socket, and remote nodes on top of it.

The serving process binds one ZeroMQ ROUTER socket (an IPC socket in a private directory by
default, or loopback TCP). Any other address (`control.bind` in placement, for workers on other
hosts) needs the shared secret from MSTAR_SECRET and is encrypted with CURVE keys derived from it
(`mstar_core.wire.curve`): a peer without the secret cannot even complete the handshake, and
nothing on the wire is readable. Workers join with an HMAC-signed Hello; every later message either way is sealed for that session
(`mstar_core.wire.session`), so a peer that can reach the socket but lacks the secret cannot
speak for a worker, whatever routing id it claims. No bytes from any peer stop the receive loop:
each refusal is logged (rate-limited) and the loop goes on. `Supervisor` (supervision.py)
replaces dead and hung workers; `WorkerLink` (worker_link.py) keeps each worker's calls in
flight. Workers are started by a launcher (`mstar_core.cluster.launchers`: a subprocess, or a
Ray actor). Each worker's big tensor frames travel through the transport its placement names, looked
up in the plugin registry (`links.py`): on this socket (`zmq`), through shared memory (`shm`), ...
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from mstar_core.cluster.launchers.spawn import spawn_worker
from mstar_core.cluster.links import OrderedInbox, open_link
from mstar_core.cluster.rank_groups import RankGroups
from mstar_core.cluster.refusals import RefusalLog
from mstar_core.cluster.remote_node import RemoteNodeScheduler, ReplicaGroup
from mstar_core.cluster.remote_values import to_wire
from mstar_core.cluster.sealed import send_sealed
from mstar_core.cluster.supervision import Supervisor
from mstar_core.cluster.worker_link import RemoteError, WorkerLink, WorkerLost
from mstar_core.config.placement import WorkerSpec
from mstar_core.errors import MStarError, RequestError
from mstar_core.runtime.engine import Invocation
from mstar_core.wire import (
    AuthError,
    ErrorReport,
    Heartbeat,
    Hello,
    InvokeNode,
    LoadModel,
    LoopDone,
    LoopValues,
    ModelLoaded,
    NodeResult,
    Release,
    Shutdown,
    WireError,
    decode,
    encode,
)
from mstar_core.wire.auth import SECRET_ENV, HelloVerifier
from mstar_core.wire.batch import split_messages
from mstar_core.wire.curve import needs_encryption, server_keys, start_asyncio_authenticator
from mstar_core.wire.session import Channel, new_session_id, session_of
from mstar_core.wire.transport import check_bind_address

__all__ = ["Cluster", "RemoteError", "RemoteNodeScheduler", "ReplicaGroup", "WorkerLost"]

#: How long a worker's Hello waits for a placement that names it (the worker waits MSTAR_JOIN_TIMEOUT, 15 s by
#: default, for its Welcome), and how many such Hellos are kept.
EARLY_HELLO_S = 60.0
MAX_EARLY_HELLOS = 64

log = logging.getLogger("mstar.cluster")

#: Sessions of lost workers remembered, to tell a worker that wakes up later to leave.
RETIRED_SESSIONS = 64


class Cluster:
    """Owns the control socket and every worker; `RemoteNodeScheduler`s send through it."""

    def __init__(self, bind: str | None = None, heartbeat_interval: float = 0.2, secret: bytes | None = None,
                 registry: Any = None, encrypt: bool | None = None):
        self.heartbeat_interval = heartbeat_interval
        self._shared_secret = secret is not None  # given by the operator (MSTAR_SECRET), not made up here
        self._auth: Any = None  # the ZAP handler of an encrypted (non-loopback) control socket
        self._encrypt = encrypt  # None: encrypt exactly when the bind address reaches beyond this host
        self.encrypted = False
        self._registry = registry  # where worker links' transports are looked up (default: the process's)
        self.secret = secret if secret is not None else secrets.token_hex(24).encode()
        self._bind = bind
        self._tmpdir: str | None = None
        self.address = ""
        self.workers: dict[str, WorkerLink] = {}
        self._sessions: dict[bytes, WorkerLink] = {}
        self._retired: collections.OrderedDict[bytes, tuple[Channel, WorkerLink]] = collections.OrderedDict()
        self._groups: dict[tuple[str, ...], ReplicaGroup] = {}
        self._verifier = HelloVerifier(self.secret)
        #: authenticated Hellos of hand-started workers that came before a placement named them, by name
        self._early: collections.OrderedDict[str, tuple[bytes, Hello, float]] = collections.OrderedDict()
        self.rank_groups = RankGroups()  # tensor-parallel groups: fail, restart and rendezvous as one
        self.supervisor = Supervisor(self)
        self.refusals = RefusalLog(log)
        self._tasks: list[asyncio.Task] = []
        self._receiver: asyncio.Task | None = None
        self.closing = False
        self.refused = 0  # peers that failed authentication
        #: called with (worker, request ids, why) when a worker is lost: fail those requests now
        self.on_requests_lost: Callable[[str, set[str], str], None] | None = None

    async def start(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # a peer claiming a routing id already in use is ignored, never handed the worker's connection
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
        bind = self._bind
        if bind is None:
            self._tmpdir = tempfile.mkdtemp(prefix="mstar-ctl-")
            bind = f"ipc://{self._tmpdir}/control"
        remote = needs_encryption(bind)
        if remote and self._encrypt is False:
            raise MStarError(f"control.bind {bind} reaches other hosts, where the control link is always encrypted; "
                             "drop control.encrypt: false")
        if remote and not self._shared_secret:
            raise MStarError(f"control.bind {bind} accepts workers from other hosts: set {SECRET_ENV} to a shared "
                             "secret (the same on every host) to start")
        check_bind_address(bind, allow_remote=remote, secret=self.secret)
        if remote or self._encrypt:
            self._auth = start_asyncio_authenticator(self.ctx, self.secret)
            server_keys(self.sock, self.secret)
            self.encrypted = True
        try:
            self.sock.bind(bind)
        except zmq.ZMQError as exc:
            raise MStarError(f"cannot bind the control socket to {bind}: {exc}") from None
        self.address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.ensure_receiving()
        self._tasks = [asyncio.ensure_future(self.supervisor.run())]

    # -- workers -------------------------------------------------------------------------------

    def add_worker(self, name: str, spec: WorkerSpec) -> WorkerLink:
        if name not in self.workers:
            # an unusable transport fails here, naming the known ones
            link = self.open_link(spec.transport, dict(spec.transport_options))
            state = self.workers[name] = WorkerLink(name, spec)
            state.link = link
            state.inbox = OrderedInbox(lambda frames, s=state: self._deliver(s, frames),
                                       lambda exc, s=state: self._link_error(s, exc))
            loop = asyncio.get_running_loop()
            link.on_failure = lambda why, s=state: loop.call_soon_threadsafe(self._link_failed, s, why)
            early = self._early.pop(name, None)
            if early is not None and not spec.spawned and time.monotonic() - early[2] < EARLY_HELLO_S:
                self._tasks.append(loop.create_task(self._welcome(early[0], early[1], state)))
        return self.workers[name]

    def _link_error(self, state: WorkerLink, exc: BaseException) -> None:
        self.refusals.refuse(f"link-{state.name}", "worker %s: a message's frames did not arrive over its %s link: %s",
                             state.name, state.link.name if state.link else "?", exc)

    def _link_failed(self, state: WorkerLink, why: str) -> None:
        """The worker's data link broke for good: nothing more can reach it, so replace it like a dead one."""
        if state.alive and not self.closing:
            self.supervisor.lost(state, f"lost its {state.link.name if state.link else '?'} link ({why})", kill=True)

    async def _launch(self, state: WorkerLink) -> None:
        state.joined.clear()
        if state.spec.launcher == "ray":
            from mstar_core.cluster.launchers.ray_actor import launch_ray_worker

            state.process = await asyncio.to_thread(launch_ray_worker, state.name, self.tcp_address(), self.secret,
                                                    state.spec, self.encrypted)
        else:
            state.process, state.log_path = await asyncio.to_thread(  # waits while the worker zygote starts
                spawn_worker, state.name, self.address, self.secret, state.spec.threads, encrypt=self.encrypted)

    def tcp_address(self) -> str:
        """A TCP endpoint of the control socket (Ray actors need one): the bind address, or an added loopback one."""
        if self.address.startswith("tcp://"):
            return self.address
        if not hasattr(self, "_tcp"):
            self.sock.bind("tcp://127.0.0.1:0")
            self._tcp = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        return self._tcp

    def _log_tail(self, state: WorkerLink, lines: int = 15) -> str:
        if not state.log_path:
            return getattr(state.process, "error", "")
        try:
            with open(state.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    async def ensure_worker(self, name: str, spec: WorkerSpec, timeout: float = 60.0) -> None:
        """Start (or wait for) a worker and return once it has joined; fail fast with its log if it cannot."""
        state = self.add_worker(name, spec)
        if state.alive:
            return
        if spec.spawned and (state.process is None or state.process.poll() is not None):
            await self._launch(state)
        deadline = time.monotonic() + timeout
        state.link_error = None
        while not state.joined.is_set():
            if state.link_error:
                raise MStarError(f"worker '{name}': {state.link_error}")
            if state.process is not None and state.process.poll() is not None:
                raise MStarError(
                    f"worker '{name}' exited with code {state.process.returncode} before joining:\n{self._log_tail(state)}"
                )
            if time.monotonic() > deadline:
                how = "" if spec.spawned else f" (start it with `mstar worker --join {self.address} --name {name}`)"
                raise MStarError(f"worker '{name}' did not join within {timeout:.0f}s{how}")
            try:
                await asyncio.wait_for(state.joined.wait(), 0.1)
            except TimeoutError:
                pass

    async def load(self, worker: str, msg: LoadModel, timeout: float = 600.0) -> None:
        """Ask a worker to build engines for some of a model's nodes; remembered for restarts."""
        state = self.workers[worker]
        state.loads[msg.model] = msg
        future = asyncio.get_running_loop().create_future()
        state.loaded[msg.model] = future
        await self._send(state, msg)
        await asyncio.wait_for(future, timeout)
        if not state.restarting:
            state.ready = True
            state.ready_since = time.monotonic()

    def kill(self, worker: str) -> None:
        """Kill a spawned worker (tests and operators); supervision restarts it."""
        state = self.workers[worker]
        if state.process is not None:
            state.process.kill()

    def retire(self, state: WorkerLink) -> None:
        """Forget a lost worker's session; a message that still comes under it gets a Shutdown back."""
        channel = state.channel
        if channel is not None:
            self._sessions.pop(channel.session, None)
            self._retired[channel.session] = (channel, state)
            while len(self._retired) > RETIRED_SESSIONS:
                self._retired.popitem(last=False)

    def requests_lost(self, worker: str, requests: set[str], why: str) -> None:
        if self.on_requests_lost is not None:
            try:
                self.on_requests_lost(worker, requests, why)
            except Exception:
                log.exception("failing the requests of lost worker %s", worker)

    # -- sending -------------------------------------------------------------------------------

    def _send(self, state: WorkerLink, msg: Any) -> asyncio.Future:
        """Encode and send now (a WireError raises here, before anything went out); await to wait for the socket."""
        return self._send_frames(state, state.encode(msg))

    def _send_frames(self, state: WorkerLink, frames: list[Any]) -> asyncio.Future:
        # sealing and handing to the socket happen in one go: sequence numbers go out in order
        if state.identity is None or state.channel is None:
            raise WorkerLost(f"worker '{state.name}' is not connected")
        if state.link is not None:
            frames = state.link.pack(frames)
            ctl = state.link.control()
            if ctl is not None:
                send_sealed(self.sock, state.channel, ctl, head=(state.identity,))
        return send_sealed(self.sock, state.channel, frames, head=(state.identity,))

    def flush_soon(self, state: WorkerLink) -> None:
        """Send the worker's link what ours has for it (e.g. the shm slots we released, the segments we mapped)."""
        if state.link is None or state.identity is None or state.channel is None:
            return
        ctl = state.link.control()
        if ctl is not None:
            send_sealed(self.sock, state.channel, ctl, head=(state.identity,))

    # -- invocations ---------------------------------------------------------------------------

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
                                             arrival=inv.arrival))
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
        asyncio.ensure_future(self._send_or_fail(state, frames, future))
        return future

    async def move_state(self, held: RemoteNodeScheduler, target: RemoteNodeScheduler, request_id: str, node: str,
                         export_index: int, import_index: int, *, arrival: float = 0.0) -> bool:
        """Move a request's engine state for `node` from `held`'s worker straight to `target`'s (no tensor through here).

        Both get one control message naming a fresh move (nonce, session id): the exporter sends the
        sealed state to the importer's peer mailbox (`links.PeerMailbox`). False when it cannot go
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

    async def _send_or_fail(self, state: WorkerLink, frames: list[Any], future: asyncio.Future) -> None:
        try:
            await self._send_frames(state, frames)
        except Exception as exc:
            if not future.done():
                future.set_exception(exc if isinstance(exc, RequestError) else WorkerLost(
                    f"worker '{state.name}': sending failed: {exc}"))

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
            await self._send_frames(state, frames)
            return await future
        finally:
            state.loops.pop(key, None)

    def release(self, worker: str, request_id: str) -> None:
        state = self.workers.get(worker)
        if state is None:
            return
        state.forget(request_id)
        if not state.alive or state.channel is None:
            return
        self.notify(worker, Release(request_id=request_id))

    def notify(self, worker: str, msg: Any) -> None:
        """Send a control message that needs no answer; a worker that is gone takes its requests with it."""
        state = self.workers.get(worker)
        if state is None or not state.alive or state.channel is None:
            return
        try:
            asyncio.ensure_future(self._send_or_fail(state, state.encode(msg), asyncio.get_running_loop().create_future()))
        except WireError:
            pass

    # -- receiving -----------------------------------------------------------------------------

    def ensure_receiving(self) -> None:
        """Start the receive loop, or restart it if it ever died (logged: it must not, but it must not stay dead)."""
        task = self._receiver
        if task is not None and not task.done():
            return
        if task is not None and not task.cancelled() and task.exception() is not None and not self.closing:
            log.error("control socket receive loop died; restarting it", exc_info=task.exception())
        if not self.closing:
            self._receiver = asyncio.ensure_future(self._recv_loop())

    async def _recv_loop(self) -> None:
        while not self.closing:
            try:
                frames = await self.sock.recv_multipart(copy=False)
            except zmq.ZMQError as exc:
                if self.closing or exc.errno == zmq.ETERM:
                    return
                self.refusals.refuse("socket", "control socket receive failed: %s", exc)
                await asyncio.sleep(0.01)
                continue
            try:
                await self._on_frames(frames[0].bytes, [f.buffer for f in frames[1:]])
            except Exception:  # a bug in handling one message must not stop the control plane
                self.refusals.refuse("bug", "control message from %r could not be handled", frames[0].bytes[:32],
                                     level=logging.ERROR, exc_info=True)

    async def _on_frames(self, identity: bytes, body: list[Any]) -> None:
        session = session_of(body)
        if session is None:  # only a Hello travels unsealed
            await self._on_unsealed(identity, body)
            return
        state = self._sessions.get(session)
        if state is None or state.channel is None:
            self._on_stale_session(identity, session, body)
            return
        try:
            body = state.channel.open(body)
        except AuthError as exc:
            self.refusals.refuse("forged", "refused a message for worker %s's session from %r: %s", state.name,
                                 identity[:32], exc)
            return
        if identity != state.identity:  # the worker reconnected: answer where its sealed messages come from
            log.info("worker %s now reaches us from routing id %r", state.name, identity)
            state.identity = identity
        state.last_seen = time.monotonic()
        state.socket_messages_received += 1
        try:
            messages = split_messages(body)  # a worker sends what one turn of its event loop produced at once
        except WireError as exc:
            self.refusals.refuse("malformed-worker", "dropping a malformed batch from worker %s: %s", state.name, exc)
            return
        for message in messages:
            self._on_message(state, message)

    def _on_message(self, state: WorkerLink, body: Any) -> None:
        if state.link is not None:
            try:
                body = state.link.unpack(body)
            except WireError as exc:
                self.refusals.refuse("malformed-worker", "dropping a malformed message from worker %s: %s",
                                     state.name, exc)
                return
            if body is None:
                return  # a message for the link itself (e.g. shm slots released, segments mapped)
        if state.inbox is not None:
            state.inbox.put(body)  # in order; frames still arriving over the link wait there, not here
        else:
            self._deliver(state, body)

    def _deliver(self, state: WorkerLink, body: list[Any]) -> None:
        try:
            msg = decode(body)
        except WireError as exc:
            self.refusals.refuse("malformed-worker", "dropping a malformed message from worker %s: %s", state.name, exc)
            return
        state.count("received", msg, body)
        self._dispatch(state, msg)

    async def _on_unsealed(self, identity: bytes, body: list[Any]) -> None:
        try:
            msg = decode(body)
        except WireError as exc:
            self.refused += 1
            self.refusals.refuse("malformed", "dropping a malformed message from unauthenticated peer %r: %s",
                                 identity[:32], exc)
            return
        if not isinstance(msg, Hello):
            self.refused += 1
            self.refusals.refuse("unauthenticated", "dropping a %s from unauthenticated peer %r (only a Hello may "
                                 "come unsealed)", type(msg).__name__, identity[:32])
            return
        await self._on_hello(identity, msg)

    def _on_stale_session(self, identity: bytes, session: bytes, body: list[Any]) -> None:
        channel, state = self._retired.get(session, (None, None))
        if channel is not None:
            try:
                channel.open(body)  # only the worker itself earns an answer
            except AuthError:
                channel = None
        if channel is None:
            self.refused += 1
            self.refusals.refuse("session", "dropping a message for an unknown session from %r", identity[:32])
            return
        self._retired.pop(session, None)
        log.warning("a worker declared lost earlier is still talking (from %r); telling it to exit", identity[:32])
        # a hand-joined worker joins again under a new session (the server reloads its models), unless another
        # process took its name meanwhile; a spawned one exits (its replacement is already on the way)
        rejoin = state is not None and not state.alive and not state.spec.spawned
        shutdown = Shutdown(reason="the server declared this worker lost (it stopped answering heartbeats, e.g. "
                                   "cut off by the network); " + ("join again" if rejoin else "it was replaced"),
                            rejoin=rejoin)
        send_sealed(self.sock, channel, encode(shutdown), head=(identity,))

    def _dispatch(self, state: WorkerLink, msg: Any) -> None:
        if isinstance(msg, NodeResult):
            state.on_result(msg)
        elif isinstance(msg, LoopValues | LoopDone):
            state.on_loop_message(msg)
        elif isinstance(msg, Heartbeat):
            state.load = msg.load
        elif isinstance(msg, ModelLoaded):
            state.on_loaded(msg)
        elif isinstance(msg, ErrorReport):
            self.refusals.refuse(f"report-{state.name}", "worker %s: %s: %s", state.name, msg.error_type, msg.message,
                                 level=logging.ERROR)
            state.on_error_report(msg)
        else:
            self.refusals.refuse("unexpected", "worker %s sent a %s, which workers never send; dropped", state.name,
                                 type(msg).__name__)

    async def _on_hello(self, identity: bytes, hello: Hello) -> None:
        state = self.workers.get(hello.worker)
        try:
            self._verifier.verify(hello)
            if state is None:
                # `mstar worker --join` may start before the server loads the model that places it: keep the
                # (authenticated) Hello a while and welcome it when a placement names the worker
                self._early[hello.worker] = (identity, hello, time.monotonic())
                self._early.move_to_end(hello.worker)
                while len(self._early) > MAX_EARLY_HELLOS:
                    self._early.popitem(last=False)
                log.info("worker %s joined before a placement named it; held for %.0f s", hello.worker, EARLY_HELLO_S)
                return
            process = state.process
            if state.spec.spawned and process is not None and process.poll() is None and hello.pid != process.pid:
                raise AuthError(f"worker {hello.worker!r} is this server's process {process.pid}; a second process "
                                f"(pid {hello.pid}) may not take its name")
        except AuthError as exc:
            self.refused += 1
            self.refusals.refuse("hello", "refused a worker: %s", exc)
            return  # say nothing: an unauthenticated peer learns nothing
        await self._welcome(identity, hello, state)

    async def _welcome(self, identity: bytes, hello: Hello, state: WorkerLink) -> None:
        """Open a session for an authenticated worker and answer its Hello."""
        session = new_session_id()
        welcome = self._verifier.welcome(hello, session=session, heartbeat_interval=self.heartbeat_interval,
                                         transport=state.spec.transport)
        if state.alive:  # the same worker joining again: what the old session had in flight is gone
            self.supervisor.lost(state, "joined again under a new session", restart=False)
        channel = Channel.for_coordinator(self.secret, hello.nonce, session)
        state.identity = identity
        state.channel = channel
        state.pid, state.host = hello.pid, hello.host
        self._sessions[channel.session] = state
        state.last_seen = time.monotonic()
        if state.link is not None:
            try:  # e.g. a tensor group's rendezvous for this worker; its set-up goes sealed right after the Welcome
                state.link.peer_joined({"control": self.address, "device": state.spec.device})
            except Exception as exc:  # not welcomed: ensure_worker fails with this reason
                state.link_error = f"its {state.link.name} link cannot be set up: {exc}"
                self._sessions.pop(channel.session, None)
                state.identity = state.channel = None
                log.error("worker %s: %s", state.name, state.link_error)
                return
        await self.sock.send_multipart([identity, *encode(welcome)])
        self.flush_soon(state)
        state.alive = True
        state.joined.set()
        if state.loads and not state.restarting:  # a hand-joined worker came back: reload its models
            self.supervisor.start_restart(state)

    def link_stats(self) -> dict[str, dict[str, Any]]:
        """Per worker: its transport, the bytes each end moved, the round trip of node calls (for /metrics)."""
        return {name: state.link_stats() for name, state in self.workers.items()}

    def worker_processes(self) -> dict[str, tuple[int, str]]:
        """Per live worker: (pid, host) as its Hello said (for /metrics: who to signal, what a restart replaced)."""
        return {name: (state.pid, state.host) for name, state in self.workers.items()
                if state.alive and state.pid is not None}

    def open_link(self, transport: str, options: dict[str, Any] | None = None):
        """The server's end of a worker link over `transport` (looked up in the plugin registry)."""
        if self._registry is None:
            from mstar_core.plugins.manager import default_registry

            self._registry = default_registry()
        return open_link(self._registry, transport, "server", options)

    # -- closing -------------------------------------------------------------------------------

    async def close(self) -> None:
        self.closing = True
        for state in self.workers.values():
            if state.alive:
                try:
                    await self._send(state, Shutdown(reason="server shutting down"))
                except Exception:
                    pass
        for state in self.workers.values():
            if state.restart_task is not None:
                state.restart_task.cancel()
            if state.process is not None:
                try:
                    await asyncio.wait_for(asyncio.to_thread(state.process.wait), 3.0)
                except TimeoutError:
                    state.process.kill()
            if state.log_path:
                try:
                    os.unlink(state.log_path)
                except OSError:
                    pass
            if state.link is not None:
                state.link.peer_lost()  # also unlinks what a worker killed above left behind
                state.link.close()
            for fut in [*state.inflight.values(), *(f for f, _ in state.loops.values())]:
                if not fut.done():
                    fut.cancel()
        for task in [*self._tasks, self._receiver]:
            if task is not None:
                task.cancel()
        if self._auth is not None:
            self._auth.stop()
        self.rank_groups.close()
        self.sock.close(0)
        self.ctx.term()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

