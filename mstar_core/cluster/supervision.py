"""Worker supervision: a dead or hung worker fails its requests within about a second and is replaced.

Every tick the supervisor polls each worker's process (an exit is seen at once) and checks when
it last heard from it. A worker silent for `silence_s` is hung (stopped, deadlocked, its event
loop blocked): it is SIGKILLed, because a stuck process that wakes up later would only compete
for the device, and its session is retired so nothing it sends afterwards counts. Then the
worker's requests fail with `WorkerLost` and a fresh process is started and reloaded, with a
back-off for workers that keep dying. Heartbeats come from the worker's event loop while its
engine steps run on a device thread, so a long step does not silence it.

The ranks of a tensor-parallel group (`rank_groups.py`) live and die together: one rank lost takes
the others down with it (a follower without its rank 0, or a rank 0 without a follower, can only
block in a collective), and the group is started and loaded again as a whole, under a new rendezvous.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from mstar_core.cluster.worker_link import WorkerLink

log = logging.getLogger("mstar.cluster")

#: Beats a worker may miss before it counts as hung (with a floor of `MIN_SILENCE_S`).
MISSED_BEATS = 5
#: Never declare a worker hung sooner than this: a busy host delays beats by a few hundred ms.
MIN_SILENCE_S = 1.0
#: Silence allowed while a worker loads its models: it serves nothing yet, so waiting costs no request,
#: and a loaded host (weights being read, imports holding the GIL) can starve its beats for seconds.
LOADING_SILENCE_S = 30.0
#: A worker that stayed ready this long restarts without back-off next time it dies.
STABLE_S = 30.0
#: When the supervisor itself ran this late (its own process stalled), that time does not count as silence.
STALL_S = 0.25


class Supervised(Protocol):
    """What the supervisor watches and restarts (`WorkerPool`): the workers, and starting and loading one."""

    closing: bool
    workers: Mapping[str, WorkerLink]

    async def ensure_worker(self, name: str, spec: Any, timeout: float = 60.0) -> None: ...

    async def load(self, worker: str, msg: Any, timeout: float = 600.0) -> None: ...


class Supervisor:
    """Watches every worker of a `Supervised` pool; restarts spawned ones, reloads hand-joined ones that rejoin.

    It is handed what else it needs: the tensor-parallel groups, how to retire a lost worker's
    session (`Sessions.retire`) and how to flush what a worker's link has for its other end.
    """

    def __init__(self, pool: Supervised, rank_groups: Any, heartbeat_interval: float, *,
                 retire: Callable[[WorkerLink], None], flush_soon: Callable[[WorkerLink], None]):
        self.pool = pool
        self.rank_groups = rank_groups
        self.heartbeat_interval = heartbeat_interval
        self._retire = retire
        self._flush_soon = flush_soon
        self.tick = min(0.1, heartbeat_interval / 2)
        #: called with (worker, request ids, why) when a worker is lost: fail those requests now
        self.on_requests_lost: Callable[[str, set[str], str], None] | None = None

    @property
    def silence_s(self) -> float:
        return max(MIN_SILENCE_S, MISSED_BEATS * self.heartbeat_interval)

    async def run(self, keep_receiving: Callable[[], None]) -> None:
        """Every tick: `keep_receiving` (restarts the control socket's receive loop should it have died), then each worker."""
        last = time.monotonic()
        while not self.pool.closing:
            await asyncio.sleep(self.tick)
            now = time.monotonic()
            stall, last = now - last - self.tick, now
            try:
                keep_receiving()
                for state in list(self.pool.workers.values()):
                    if stall > STALL_S:  # this process stalled: the beats wait unread in the socket
                        state.last_seen += stall
                    if state.alive and not self.pool.closing:
                        self._check(state, now)
            except Exception:  # the supervisor must outlive any one worker's trouble
                log.exception("worker supervision failed a round; continuing")

    def _check(self, state: WorkerLink, now: float) -> None:
        self._flush_soon(state)
        process = state.process
        if process is not None and process.poll() is not None:
            self.lost(state, f"exited with code {process.returncode}")
        elif now - state.last_seen > (self.silence_s if state.ready else max(self.silence_s, LOADING_SILENCE_S)):
            self.lost(state, f"stopped answering heartbeats for {now - state.last_seen:.1f}s (hung); killed it",
                      kill=True)

    def lost(self, state: WorkerLink, why: str, kill: bool = False, restart: bool = True) -> None:
        """Fail the worker's requests now; kill its process if asked; start replacing it (spawned workers).

        A rank of a group takes the whole group down, and the group is replaced as one.
        """
        group = self.rank_groups.group_of(state.name)
        if group is not None:
            self._lose(state, why, kill)
            for name in group:
                other = self.pool.workers.get(name)
                if other is not None and other is not state and other.alive:
                    self._lose(other, f"went down with its tensor-parallel group ({state.name} {why})", True)
            if restart and state.spec.spawned and not self.pool.closing:
                self.start_group_restart(group)
            return
        self._lose(state, why, kill)
        if restart and state.spec.spawned and not self.pool.closing:
            self.start_restart(state)

    def _lose(self, state: WorkerLink, why: str, kill: bool) -> None:
        log.error("worker %s %s; failing its %d in-flight calls and %d requests", state.name, why,
                  len(state.inflight) + len(state.loops), len(state.touched))
        if kill and state.process is not None:
            try:
                state.process.kill()
            except Exception:  # already gone
                pass
        self._retire(state)
        requests = state.lost(why)
        if requests:
            self._requests_lost(state.name, requests, why)

    def _requests_lost(self, worker: str, requests: set[str], why: str) -> None:
        if self.on_requests_lost is not None:
            try:
                self.on_requests_lost(worker, requests, why)
            except Exception:
                log.exception("failing the requests of lost worker %s", worker)

    def start_group_restart(self, group: tuple[str, ...]) -> None:
        states = [self.pool.workers[name] for name in group]
        task = states[0].restart_task
        if task is None or task.done():
            task = asyncio.ensure_future(self._restart_group(states))
            for state in states:
                state.restarting = True
                state.restart_task = task

    async def _restart_group(self, states: list[WorkerLink]) -> None:
        """Start every rank again, then load them together (they meet at a new rendezvous); ready only when all are."""
        group, failures, first = tuple(s.name for s in states), 0, states[0]
        try:
            while not self.pool.closing:
                unstable = time.monotonic() - first.ready_since < STABLE_S
                await asyncio.sleep(min(5.0, 0.2 * 2 ** (failures + (first.restarts if unstable else 0))))
                for state in states:
                    state.restarts += 1
                try:
                    for state in states:
                        if state.alive:  # a rank left over from a failed attempt: it waits at the old rendezvous
                            self._lose(state, "was restarted with its tensor-parallel group", True)
                        await self._reap(state)
                    await asyncio.gather(*(self.pool.ensure_worker(s.name, s.spec) for s in states))
                    self.rank_groups.renew(group)
                    for model in list(first.loads):
                        await asyncio.gather(*(self.pool.load(s.name, self.rank_groups.load_message(
                            s.loads[model], group, i, s.loads[model].device)) for i, s in enumerate(states)))
                except Exception as exc:
                    failures += 1
                    log.error("tensor-parallel group %s failed to restart (attempt %d): %s", ", ".join(group),
                              failures, exc)
                    continue
                now = time.monotonic()
                for state in states:
                    state.ready, state.ready_since = True, now
                log.warning("tensor-parallel group %s restarted (%d restarts) and reloaded its models",
                            ", ".join(group), first.restarts)
                return
        finally:
            for state in states:
                state.restarting = False

    def start_restart(self, state: WorkerLink) -> None:
        if state.restart_task is None or state.restart_task.done():
            state.restarting = True
            state.restart_task = asyncio.ensure_future(self._restart(state))

    async def _restart(self, state: WorkerLink) -> None:
        failures = 0
        try:
            while not self.pool.closing:
                unstable = time.monotonic() - state.ready_since < STABLE_S
                await asyncio.sleep(min(5.0, 0.2 * 2 ** (failures + (state.restarts if unstable else 0))))
                state.restarts += 1
                try:
                    if state.alive:
                        pass  # it joined again by itself (a hand-started worker): only reload
                    elif state.spec.spawned:
                        await self._reap(state)
                        await self.pool.ensure_worker(state.name, state.spec)
                    else:
                        await state.joined.wait()
                    for msg in list(state.loads.values()):
                        await self.pool.load(state.name, msg)
                except Exception as exc:
                    failures += 1
                    log.error("worker %s failed to restart (attempt %d): %s", state.name, failures, exc)
                    continue
                state.ready = True
                state.ready_since = time.monotonic()
                log.warning("worker %s restarted (%d restarts) and reloaded its models", state.name, state.restarts)
                return
        finally:
            state.restarting = False

    @staticmethod
    async def _reap(state: WorkerLink) -> None:
        """Make sure the old process is gone before its replacement starts (a hung one was SIGKILLed)."""
        process = state.process
        if process is None or process.poll() is not None:
            return
        try:
            process.kill()
        except Exception:
            pass
        try:
            await asyncio.wait_for(asyncio.to_thread(process.wait, 10), 15)
        except Exception:
            log.error("worker %s (pid %s) did not exit after SIGKILL", state.name, getattr(process, "pid", "?"))
