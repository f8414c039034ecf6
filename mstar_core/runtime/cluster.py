"""The coordinator side of multi-process serving: worker processes, supervision, remote nodes.

The serving process binds one ZeroMQ ROUTER socket (an IPC socket in a private directory by
default, or loopback TCP; any other address must be configured explicitly). Workers join with an
HMAC-signed Hello. Heartbeats and process polling detect a dead worker; its in-flight requests
fail at once with a 503-style error, the worker is restarted and its models reloaded. Workers are
started by a launcher (`mstar_core.runtime.launchers`: a subprocess, or a Ray actor); a worker
with `transport: shm` moves big tensor frames through shared memory (`launchers.shm_path`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import tempfile
import time
import zlib
from typing import Any

import zmq
import zmq.asyncio

from mstar_core.config.placement import WorkerSpec
from mstar_core.errors import MStarError, NodeExecutionError, RequestError
from mstar_core.runtime.engine import Invocation
from mstar_core.runtime.launchers import shm_path
from mstar_core.runtime.launchers.spawn import spawn_worker
from mstar_core.runtime.remote_values import from_wire, to_wire
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
    RunLoop,
    Shutdown,
    WireError,
    decode,
    encode,
)
from mstar_core.wire.auth import HelloVerifier
from mstar_core.wire.transport import check_bind_address

log = logging.getLogger("mstar.cluster")

#: How long a worker may stay silent (in heartbeat intervals) before it is declared dead. Generous,
#: because a busy host (weights loading, a long step holding the GIL) delays beats; a spawned
#: worker's exit is caught at once by polling its process, whatever this says.
MISSED_BEATS = 10


class WorkerLost(RequestError):
    """The worker running part of this request died; the request may be retried."""

    status = 503


class RemoteError(Exception):
    """An exception raised inside a worker process, carried back by name and message."""


class _WorkerState:
    def __init__(self, name: str, spec: WorkerSpec):
        self.name = name
        self.spec = spec
        self.identity: bytes | None = None
        self.process: Any = None  # a subprocess.Popen, or a launcher's handle with the same interface
        self.link: shm_path.ShmLink | None = None  # the shm data path, for `transport: shm`
        self.log_path: str | None = None
        self.last_seen = 0.0
        self.joined = asyncio.Event()
        self.loads: dict[str, LoadModel] = {}  # model -> what to replay after a restart
        self.loaded: dict[str, asyncio.Future] = {}
        self.inflight: dict[tuple[str, str, int], asyncio.Future] = {}
        # delegated loops: (request id, loop index) -> (future of the env delta, values callback)
        self.loops: dict[tuple[str, int], tuple[asyncio.Future, Any]] = {}
        self.load: dict[str, Any] = {}  # the engines' gauges from the last heartbeat, by 'model/node'
        self.restarts = 0
        self.alive = False  # connected and answering heartbeats
        self.ready = False  # has loaded its models and accepts invocations
        self.restarting = False


class Cluster:
    """Owns the control socket and every worker; `RemoteNodeScheduler`s send through it."""

    def __init__(self, bind: str | None = None, heartbeat_interval: float = 0.5, secret: bytes | None = None):
        self.heartbeat_interval = heartbeat_interval
        self.secret = secret if secret is not None else secrets.token_hex(24).encode()
        self._bind = bind
        self._tmpdir: str | None = None
        self.address = ""
        self.workers: dict[str, _WorkerState] = {}
        self._by_identity: dict[bytes, _WorkerState] = {}
        self._verifier = HelloVerifier(self.secret)
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        self.refused = 0  # peers that failed authentication

    async def start(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker may reuse its identity
        bind = self._bind
        if bind is None:
            self._tmpdir = tempfile.mkdtemp(prefix="mstar-ctl-")
            bind = f"ipc://{self._tmpdir}/control"
        check_bind_address(bind, allow_remote=False, secret=self.secret)
        self.sock.bind(bind)
        self.address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._tasks = [asyncio.ensure_future(self._recv_loop()), asyncio.ensure_future(self._monitor())]

    # -- workers -------------------------------------------------------------------------------

    def add_worker(self, name: str, spec: WorkerSpec) -> _WorkerState:
        if name not in self.workers:
            self.workers[name] = _WorkerState(name, spec)
        return self.workers[name]

    async def _launch(self, state: _WorkerState) -> None:
        state.joined.clear()
        if state.spec.launcher == "ray":
            from mstar_core.runtime.launchers.ray_actor import launch_ray_worker

            state.process = await asyncio.to_thread(launch_ray_worker, state.name, self.tcp_address(), self.secret,
                                                    state.spec)
        else:
            state.process, state.log_path = spawn_worker(state.name, self.address, self.secret, state.spec.transport,
                                                         state.spec.threads)

    def tcp_address(self) -> str:
        """A TCP endpoint of the control socket (Ray actors need one): the bind address, or an added loopback one."""
        if self.address.startswith("tcp://"):
            return self.address
        if not hasattr(self, "_tcp"):
            self.sock.bind("tcp://127.0.0.1:0")
            self._tcp = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        return self._tcp

    def _log_tail(self, state: _WorkerState, lines: int = 15) -> str:
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
        while not state.joined.is_set():
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

    async def _send(self, state: _WorkerState, msg: Any) -> None:
        if state.identity is None:
            raise WorkerLost(f"worker '{state.name}' is not connected")
        frames = encode(msg)
        if state.link is not None:
            frames = state.link.pack(frames)
            await self._flush(state)
        await self.sock.send_multipart([state.identity, *frames], copy=False)

    async def _flush(self, state: _WorkerState) -> None:
        """Tell an shm worker which of its slots we released and which segments we mapped."""
        ctl = state.link.control() if state.link is not None and state.identity is not None else None
        if ctl is not None:
            await self.sock.send_multipart([state.identity, *ctl], copy=False)

    # -- invocations ---------------------------------------------------------------------------

    def invoke(self, worker: str, model: str, inv: Invocation) -> asyncio.Future:
        state = self.workers[worker]
        future = asyncio.get_running_loop().create_future()
        if not state.ready:
            future.set_exception(WorkerLost(f"worker '{worker}' is down (restarting); retry the request"))
            return future
        node = f"{model}/{inv.node}"
        state.inflight[(inv.request_id, node, inv.call_index)] = future
        msg = InvokeNode(request_id=inv.request_id, node=node, call_index=inv.call_index,
                         inputs=to_wire(inv.inputs), options=to_wire(dict(inv.options)))
        asyncio.ensure_future(self._send_or_fail(state, msg, future))
        return future

    async def _send_or_fail(self, state: _WorkerState, msg: Any, future: asyncio.Future) -> None:
        try:
            await self._send(state, msg)
        except Exception as exc:
            if not future.done():
                future.set_exception(exc if isinstance(exc, RequestError) else WorkerLost(str(exc)))

    async def run_loop(self, worker: str, msg: RunLoop, on_values: Any) -> dict[str, Any]:
        """Run a walk's loop on `worker`; `on_values(call, outputs)` sees its visible values in order.

        Returns the env names the loop changed. A WireError (an env value that cannot travel)
        surfaces before anything was sent, so the caller can run the loop itself instead.
        """
        state = self.workers[worker]
        if not state.ready:
            raise WorkerLost(f"worker '{worker}' is down (restarting); retry the request")
        key = (msg.request_id, msg.loop)
        future = asyncio.get_running_loop().create_future()
        state.loops[key] = (future, on_values)
        try:
            await self._send(state, msg)
            return await future
        finally:
            state.loops.pop(key, None)

    def _on_loop_message(self, state: _WorkerState, msg: LoopValues | LoopDone) -> None:
        entry = state.loops.get((msg.request_id, msg.loop))
        if entry is None or entry[0].done():
            return
        future, on_values = entry
        if isinstance(msg, LoopValues):
            try:
                on_values(msg.call, from_wire(msg.outputs))
            except Exception as exc:  # e.g. a stream's `keep` raised: fail this request, not the socket
                future.set_exception(exc)
        elif msg.error is not None:
            cause = RemoteError(f"{msg.error_type}: {msg.error}")
            future.set_exception(NodeExecutionError(msg.node or "?", msg.request_id, cause))
        else:
            future.set_result(from_wire(msg.env))

    def release(self, worker: str, request_id: str) -> None:
        state = self.workers.get(worker)
        if state is None or not state.alive:
            return
        for key in [k for k in state.inflight if k[0] == request_id]:
            fut = state.inflight.pop(key)
            if not fut.done():
                fut.cancel()
        for key in [k for k in state.loops if k[0] == request_id]:
            fut = state.loops.pop(key)[0]
            if not fut.done():
                fut.cancel()
        asyncio.ensure_future(self._send_or_fail(state, Release(request_id=request_id), asyncio.Future()))

    # -- receiving -----------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            identity, body = frames[0].bytes, [f.buffer for f in frames[1:]]
            state = self._by_identity.get(identity)
            try:
                if body and shm_path.kind(body) is not None:
                    if state is None or state.link is None:
                        continue  # shared memory is only for authenticated shm workers
                    body = state.link.unpack(body)
                    if body is None:
                        continue  # a control message: slots released, segments mapped
                msg = decode(body)
            except WireError as exc:
                log.warning("dropping a malformed message from %r: %s", identity, exc)
                continue
            if isinstance(msg, Hello):
                await self._on_hello(identity, msg)
                continue
            if state is None:
                log.warning("message from an unauthenticated peer %r dropped", identity)
                continue
            state.last_seen = time.monotonic()
            if isinstance(msg, NodeResult):
                future = state.inflight.pop((msg.request_id, msg.node, msg.call_index), None)
                if future is None or future.done():
                    continue
                if msg.error is not None:
                    node = msg.node.split("/", 1)[-1]
                    future.set_exception(NodeExecutionError(node, msg.request_id, RemoteError(f"{msg.error_type}: {msg.error}")))
                else:
                    future.set_result(from_wire(msg.outputs))
            elif isinstance(msg, LoopValues | LoopDone):
                self._on_loop_message(state, msg)
            elif isinstance(msg, ModelLoaded):
                fut = state.loaded.get(msg.model)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, ErrorReport):
                log.error("worker %s: %s: %s", state.name, msg.error_type, msg.message)
                for fut in state.loaded.values():
                    if not fut.done():
                        fut.set_exception(MStarError(f"worker '{state.name}': {msg.message}"))
            elif isinstance(msg, Heartbeat):
                state.load = msg.load

    async def _on_hello(self, identity: bytes, hello: Hello) -> None:
        state = self.workers.get(hello.worker)
        try:
            self._verifier.verify(hello)
            if state is None:
                raise AuthError(f"no worker named '{hello.worker}' in the placement")
        except AuthError as exc:
            self.refused += 1
            log.warning("refused a worker: %s", exc)
            return  # say nothing: an unauthenticated peer learns nothing
        welcome = self._verifier.welcome(hello, session=secrets.token_hex(8), heartbeat_interval=self.heartbeat_interval)
        if state.identity is not None:
            self._by_identity.pop(state.identity, None)
        state.identity = identity
        self._by_identity[identity] = state
        if state.spec.transport == "shm" and state.link is None:
            state.link = shm_path.ShmLink()
        state.last_seen = time.monotonic()
        await self.sock.send_multipart([identity, *encode(welcome)])
        state.alive = True
        state.joined.set()

    # -- supervision ---------------------------------------------------------------------------

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(min(0.1, self.heartbeat_interval / 2))
            now = time.monotonic()
            for state in list(self.workers.values()):
                if not state.alive or self._closing:
                    continue  # while closing, workers exiting is expected
                await self._flush(state)
                exited = state.process is not None and state.process.poll() is not None
                silent = now - state.last_seen > MISSED_BEATS * self.heartbeat_interval
                if exited or silent:
                    why = f"exited with code {state.process.returncode}" if exited else "stopped answering heartbeats"
                    self._lost(state, why)
                    if state.spec.spawned and not self._closing:
                        asyncio.ensure_future(self._restart(state))

    def _lost(self, state: _WorkerState, why: str) -> None:
        log.error("worker %s %s; failing its %d in-flight calls", state.name, why, len(state.inflight))
        state.alive = False
        state.ready = False
        state.joined.clear()
        if state.identity is not None:
            self._by_identity.pop(state.identity, None)
            state.identity = None
        if state.link is not None:
            state.link.peer_lost()
        inflight, state.inflight = state.inflight, {}
        loops, state.loops = state.loops, {}
        for fut in [*inflight.values(), *(f for f, _ in loops.values())]:
            if not fut.done():
                fut.set_exception(WorkerLost(f"worker '{state.name}' {why}; the request was lost, retry it"))

    async def _restart(self, state: _WorkerState) -> None:
        await asyncio.sleep(min(5.0, 0.2 * 2**state.restarts))
        state.restarts += 1
        state.restarting = True
        try:
            await self.ensure_worker(state.name, state.spec)
            for msg in state.loads.values():
                await self.load(state.name, msg)
            state.restarting = False
            state.ready = True
            log.warning("worker %s restarted (%d restarts) and reloaded its models", state.name, state.restarts)
        except Exception:
            log.exception("worker %s failed to restart", state.name)
            if not self._closing:
                asyncio.ensure_future(self._restart(state))

    def kill(self, worker: str) -> None:
        """Kill a spawned worker (tests and operators); supervision restarts it."""
        state = self.workers[worker]
        if state.process is not None:
            state.process.kill()

    async def close(self) -> None:
        self._closing = True
        for state in self.workers.values():
            if state.alive:
                try:
                    await self._send(state, Shutdown(reason="server shutting down"))
                except Exception:
                    pass
        for state in self.workers.values():
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
            for fut in state.inflight.values():
                if not fut.done():
                    fut.cancel()
        for task in self._tasks:
            task.cancel()
        self.sock.close(0)
        self.ctx.term()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)


class RemoteNodeScheduler:
    """Stands in for a `NodeScheduler` whose engine lives in worker processes.

    A request sticks to one replica (its KV pages live there); the choice is a hash of the id.
    """

    def __init__(self, cluster: Cluster, model: str, node: str, replicas: list[str]):
        self.cluster = cluster
        self.model = model
        self.node = node
        self.replicas = replicas

    def replica_for(self, request_id: str) -> str:
        return self.replicas[zlib.crc32(request_id.encode()) % len(self.replicas)]

    def submit(self, invocation: Invocation) -> asyncio.Future:
        return self.cluster.invoke(self.replica_for(invocation.request_id), self.model, invocation)

    def release(self, request_id: str) -> None:
        self.cluster.release(self.replica_for(request_id), request_id)

    async def close(self) -> None:
        return None
