"""Every worker's life as the serving process runs it: add, launch, wait for its join, load, kill, shut down.

Workers are started by a launcher (`mstar_core.cluster.launchers`: a subprocess, or a Ray actor)
or by hand (`mstar worker --join`). Each worker's big tensor frames travel through the transport
its placement names, looked up in the plugin registry (`links.py`): on the control socket (`zmq`),
through shared memory (`shm`), ... A link that breaks for good is reported to `on_link_lost`
(supervision replaces the worker like a dead one).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

from mstar_core.cluster.control_socket import ControlSocket
from mstar_core.cluster.launchers.spawn import spawn_worker
from mstar_core.cluster.links import OrderedInbox, open_link
from mstar_core.cluster.refusals import RefusalLog
from mstar_core.cluster.sender import WorkerSender
from mstar_core.cluster.worker_link import WorkerLink
from mstar_core.config.placement import WorkerSpec
from mstar_core.errors import MStarError
from mstar_core.wire import LoadModel, Shutdown


class WorkerPool:
    """The `WorkerLink` of every worker by name, and starting, loading and stopping their processes."""

    def __init__(self, socket: ControlSocket, sender: WorkerSender, deliver: Callable[[WorkerLink, list[Any]], None],
                 refusals: RefusalLog, registry: Any = None):
        self.socket = socket
        self.sender = sender
        self._deliver = deliver  # where a message whose frames came over a worker's link goes, in order
        self.refusals = refusals
        self._registry = registry  # where worker links' transports are looked up (default: the process's)
        self.workers: dict[str, WorkerLink] = {}
        self.closing = False
        #: called with (worker, why) when a worker's data link broke for good: replace it like a dead one
        self.on_link_lost: Callable[[WorkerLink, str], None] | None = None

    def add(self, name: str, spec: WorkerSpec) -> WorkerLink:
        """The worker named `name`, made (with its link) the first time a placement names it."""
        if name not in self.workers:
            # an unusable transport fails here, naming the known ones
            link = self.open_link(spec.transport, dict(spec.transport_options))
            state = self.workers[name] = WorkerLink(name, spec)
            state.link = link
            state.inbox = OrderedInbox(lambda frames, s=state: self._deliver(s, frames),
                                       lambda exc, s=state: self._link_error(s, exc))
            loop = asyncio.get_running_loop()
            link.on_failure = lambda why, s=state: loop.call_soon_threadsafe(self._link_failed, s, why)
        return self.workers[name]

    def open_link(self, transport: str, options: dict[str, Any] | None = None):
        """The server's end of a worker link over `transport` (looked up in the plugin registry)."""
        if self._registry is None:
            from mstar_core.plugins.manager import default_registry

            self._registry = default_registry()
        return open_link(self._registry, transport, "server", options)

    def _link_error(self, state: WorkerLink, exc: BaseException) -> None:
        self.refusals.refuse(f"link-{state.name}", "worker %s: a message's frames did not arrive over its %s link: %s",
                             state.name, state.link.name if state.link else "?", exc)

    def _link_failed(self, state: WorkerLink, why: str) -> None:
        """The worker's data link broke for good: nothing more can reach it, so replace it like a dead one."""
        if state.alive and not self.closing and self.on_link_lost is not None:
            self.on_link_lost(state, f"lost its {state.link.name if state.link else '?'} link ({why})")

    async def _launch(self, state: WorkerLink) -> None:
        state.joined.clear()
        if state.spec.launcher == "ray":
            from mstar_core.cluster.launchers.ray_actor import launch_ray_worker

            state.process = await asyncio.to_thread(launch_ray_worker, state.name, self.socket.tcp_address(),
                                                    self.socket.secret, state.spec, self.socket.encrypted)
        else:
            state.process, state.log_path = await asyncio.to_thread(  # waits while the worker zygote starts
                spawn_worker, state.name, self.socket.address, self.socket.secret, state.spec.threads,
                encrypt=self.socket.encrypted)

    @staticmethod
    def _log_tail(state: WorkerLink, lines: int = 15) -> str:
        if not state.log_path:
            return getattr(state.process, "error", "")
        try:
            with open(state.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    async def ensure_worker(self, name: str, spec: WorkerSpec, timeout: float = 60.0) -> None:
        """Start (or wait for) a worker and return once it has joined; fail fast with its log if it cannot."""
        state = self.add(name, spec)
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
                how = "" if spec.spawned else f" (start it with `mstar worker --join {self.socket.address} --name {name}`)"
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
        await self.sender.send(state, msg)
        await asyncio.wait_for(future, timeout)
        if not state.restarting:
            state.ready = True
            state.ready_since = time.monotonic()

    def kill(self, worker: str) -> None:
        """Kill a spawned worker (tests and operators); supervision restarts it."""
        state = self.workers[worker]
        if state.process is not None:
            state.process.kill()

    def link_stats(self) -> dict[str, dict[str, Any]]:
        """Per worker: its transport, the bytes each end moved, the round trip of node calls (for /metrics)."""
        return {name: state.link_stats() for name, state in self.workers.items()}

    def worker_processes(self) -> dict[str, tuple[int, str]]:
        """Per live worker: (pid, host) as its Hello said (for /metrics: who to signal, what a restart replaced)."""
        return {name: (state.pid, state.host) for name, state in self.workers.items()
                if state.alive and state.pid is not None}

    async def close(self) -> None:
        """Tell every live worker to leave, wait a little for each process, then release its link and its calls."""
        self.closing = True
        for state in self.workers.values():
            if state.alive:
                try:
                    await self.sender.send(state, Shutdown(reason="server shutting down"))
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
