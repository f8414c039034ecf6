"""The micro-scheduler: one per (worker, node); batches ready invocations across requests.

It hands invocations that reach the node to the engine, at most `engine.max_batch_size` held at
once (the rest wait here: the most urgent `Invocation.priority` first, then the oldest request by
`Invocation.arrival`), and, with `engine.max_active_requests`, from at most that many requests at a
time (admitted oldest first, each until it is released or exports its state to another worker: so
a few requests finish early instead of all of them late, and none waits behind a younger one). With
`engine.admit_streams` it admits the oldest waiting request only while the admitted streams keep their
listeners ahead (`runtime.stream_admission`: the leads the calls carry, read as they are submitted). With
`engine.call_order == "fifo"` (plain fairness) calls go in submission order instead: each is handed
over at priority 0, stamped with its submission as its arrival, so an engine that orders by
`Invocation.urgency` follows it too.

It calls `engine.step()` on the worker's device thread while the engine has work, so the event loop
stays free. Invocations that arrive while a step runs are batched into the next one. Nodes sharing a device
thread take turns on it (a lock per thread): a node waits for its turn before it hands its calls to the
engine, so calls that reach it during other nodes' steps join one batch (a pipeline of nodes, as a speech
model's Talker -> code predictor -> glue, otherwise splits its requests into a small batch per stage). Releases
(finished, failed or cancelled requests) are applied between steps, never during one. It never dies
silently: an `add` that raises fails that invocation alone, and if the loop itself breaks, a
supervisor logs why, fails what was in flight and starts it again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import attrs

from mstar_core.errors import NodeExecutionError
from mstar_core.runtime.engine import Engine, Invocation, is_background
from mstar_core.runtime.stream_admission import StreamLeads

log = logging.getLogger("mstar.scheduler")

#: executor -> (event loop, the lock its nodes' steps take): one node steps on a shared device thread at a time
_TURNS: weakref.WeakKeyDictionary[Executor, tuple[asyncio.AbstractEventLoop, asyncio.Lock]] = (
    weakref.WeakKeyDictionary())


def _urgency(entry: tuple[Invocation, asyncio.Future]) -> tuple[float, float]:
    return entry[0].urgency


def run_on_device(loop: asyncio.AbstractEventLoop, executor: Executor, fn: Callable[[], Any]) -> asyncio.Future:
    """`fn()` on the executor's thread, as `loop.run_in_executor` runs it, for less: the thread hands its result to
    the loop itself (one `call_soon_threadsafe`), with no `concurrent.futures.Future` chained to an asyncio one.

    A step's result reaches the loop once per token at c=1; the chained futures cost a condition variable, a
    callback list and two loop callbacks on top of the wake-up. As there, a call whose future was cancelled before
    the thread reached it does not run (a scheduler closed with a step queued); one cancelled while it runs finishes
    and its result is dropped, as is one whose loop closed meanwhile.
    """
    future = loop.create_future()

    def run() -> None:
        if future.cancelled():  # (read across threads: a stale "not yet" only runs the call, as a started one would)
            return
        try:
            result = fn()
        except BaseException as exc:  # (handed to the awaiting task, as run_in_executor hands it)
            settle = (_set_exception, future, exc)
        else:
            settle = (_set_result, future, result)
        try:
            loop.call_soon_threadsafe(*settle)
        except RuntimeError:  # the loop closed while the step ran: nobody awaits it
            pass

    executor.submit(run)
    return future


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


class NodeScheduler:
    """Feeds one engine and resolves each invocation's future when the engine finishes it."""

    def __init__(self, engine: Engine, executor: Executor | None, clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self._clock = clock  # when a call's lead was read (the conductor reads it on the same clock, just before)
        self.executor = executor
        self.inline = executor is None or engine.inline or bool(engine.node.options.get("inline", False))
        self._pending: deque[tuple[Invocation, asyncio.Future]] = deque()
        self._inflight: dict[int, tuple[Invocation, asyncio.Future]] = {}
        self._releases: set[str] = set()
        self._chores: deque[tuple[Callable[[], Any], asyncio.Future]] = deque()  # see `between_steps`
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self._last_step_ok = False  # a step completed since the last crash (resets the restart backoff)
        limit = getattr(engine, "max_active_requests", None)
        admit_streams = getattr(engine, "admit_streams", None)
        #: the admitted requests' leads and speeds, when admission follows them (node setting `admit_streams`)
        self._leads = StreamLeads(admit_streams) if admit_streams is not None else None
        #: requests whose calls may reach the engine (insertion order = admission order); None: no limit
        self._admitted: dict[str, None] | None = {} if limit or self._leads is not None else None
        self._limit = int(limit or 0)  # 0: no fixed limit
        # "fifo": plain fairness, calls in submission order (no stream priority, no request age); a counter, not a
        # clock, so two calls submitted in the same tick keep their order
        self._submissions = itertools.count() if getattr(engine, "call_order", "urgency") == "fifo" else None
        # observability
        self.steps = 0
        self.invocations = 0
        self.last_batch_size = 0
        self.last_step_seconds = 0.0
        self.step_seconds_total = 0.0  # wall time inside steps (over a run's wall time: the share of it in forwards)

    def _ensure_started(self) -> None:
        if self._task is None or self._task.done():
            loop = asyncio.get_running_loop()
            self._wakeup = asyncio.Event()
            self._task = loop.create_task(self._run(), name=f"mstar-node-{self.engine.node.name}")

    def submit(self, invocation: Invocation) -> asyncio.Future:
        """Queue an invocation; the returned future resolves to its outputs dict."""
        if self._closed:
            raise RuntimeError(f"node '{self.engine.node.name}' is shut down")
        self._ensure_started()
        if self._submissions is not None:  # (a copy: the caller's invocation keeps its request's arrival)
            invocation = attrs.evolve(invocation, priority=0.0, arrival=float(next(self._submissions)))
        if self._leads is not None:
            self._leads.observe(invocation.request_id, invocation.lead, self._clock())
        future = asyncio.get_running_loop().create_future()
        self._pending.append((invocation, future))
        self._wakeup.set()
        return future

    def _admit_oldest(self) -> None:
        """Fill free places with the oldest waiting requests: admission goes strictly by arrival, so none starves
        (background requests, `engine.BACKGROUND_PRIORITY`, after every live one: their submitter bounds them).

        (Within the admitted, calls still go most urgent first; an admitted request keeps its place
        until it is released, or its state leaves with an export, so it finishes while the later ones
        wait instead of all finishing late.)
        """
        admitted = self._admitted
        free = self._limit - len(admitted) if self._limit else len(self._pending)
        if free <= 0:
            return
        waiting: dict[str, tuple[bool, float]] = {}  # live requests before background ones, each class oldest first
        for inv, fut in self._pending:
            if inv.request_id not in admitted and not fut.done():
                waiting.setdefault(inv.request_id, (is_background(inv.priority), inv.arrival))
        for rid in sorted(waiting, key=waiting.__getitem__)[:free]:
            if self._leads is not None and not self._leads.may_admit(admitted):
                break  # (strictly by age: a younger request never takes a place the oldest may not)
            admitted[rid] = None
            log.debug("node %s: admitted request %s (%d admitted)", self.engine.node.name, rid, len(admitted))

    def release(self, request_id: str) -> None:
        """Forget a request: drop its queued invocations now, free engine state before the next step."""
        if self._admitted is not None:
            self._admitted.pop(request_id, None)
        if self._leads is not None:
            self._leads.forget(request_id)
        if any(inv.request_id == request_id for inv, _ in self._pending):
            self._pending = deque((i, f) for i, f in self._pending if i.request_id != request_id)
        self._releases.add(request_id)
        if self._wakeup is not None:
            self._wakeup.set()
        elif self._task is None:
            self._apply_releases()

    async def between_steps(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine's device thread between two steps, after every release asked for before it (so a
        chore such as unloading an adapter sees the engine without the requests just cancelled)."""
        if self._task is None or self._task.done():  # no loop: nothing steps, apply the releases here
            self._apply_releases()
            if self.inline:
                return fn()
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn)
        future = asyncio.get_running_loop().create_future()
        self._chores.append((fn, future))
        self._wakeup.set()
        return await future

    async def _run_chores(self) -> None:
        while self._chores:
            fn, future = self._chores.popleft()
            try:
                result = fn() if self.inline else await asyncio.get_running_loop().run_in_executor(self.executor, fn)
            except Exception as exc:
                if not future.done():
                    future.set_exception(exc)
            else:
                if not future.done():
                    future.set_result(result)

    def _apply_releases(self) -> None:
        releases, self._releases = self._releases, set()
        for rid in releases:
            for key in [k for k, (inv, _) in self._inflight.items() if inv.request_id == rid]:
                _, fut = self._inflight.pop(key)
                if not fut.done():
                    fut.cancel()
            try:
                self.engine.release(rid)
            except Exception:  # a release must never take the scheduler down
                log.exception("engine %s failed to release request %s", self.engine.node.name, rid)

    async def _run(self) -> None:
        """Supervise the loop: a crash is logged, what was in flight fails, and the loop starts again at once.

        Without this an unexpected exception would end the task silently, leaving every stream on
        the node frozen until some unrelated submission happened to restart it.
        """
        name = self.engine.node.name
        crashes = 0
        while not self._closed:
            try:
                await self._loop()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                crashes = 1 if self._last_step_ok else crashes + 1
                self._last_step_ok = False
                log.exception("node %s: scheduler loop crashed (%d in a row); failing %d in-flight invocation(s) "
                              "and restarting it", name, crashes, len(self._inflight))
                self._fail_inflight(exc)
                # a loop that breaks on every pass would otherwise spin and flood the log
                await asyncio.sleep(0 if crashes == 1 else min(1.0, 0.01 * 2**crashes))

    async def _loop(self) -> None:
        turn = self._device_turn()
        while not self._closed:
            if self._releases:
                self._apply_releases()
            if self._chores:
                await self._run_chores()
            if turn is not None and (self._pending or self.engine.has_work()):
                # wait for the shared device thread here, not in its queue: calls that reach this node while
                # another node's step runs join this node's next batch instead of making a batch of their own
                async with turn:
                    if self._releases:
                        self._apply_releases()
                    state, held = await self._pass()
            else:
                state, held = await self._pass()
            if state == "stepped":
                # Let the requests just answered come back before the next batch forms: their tasks
                # were woken ahead of this one, so one pass of the loop resubmits every AR step that
                # goes straight back to this node. Without it, work that arrived during the step
                # runs alone while the rest re-queue, and the batch splits into groups that take
                # turns for as long as they run (each step paying for the weights once per group).
                await asyncio.sleep(0)
            elif state == "idle":
                await self._idle(held)

    def _device_turn(self) -> asyncio.Lock | None:
        """The lock this node's steps take on a device thread other nodes share (None: inline or a thread of its own)."""
        if self.inline or self.engine.own_thread:
            return None
        loop = asyncio.get_running_loop()
        held = _TURNS.get(self.executor)
        if held is None or held[0] is not loop:
            held = _TURNS[self.executor] = (loop, asyncio.Lock())
        return held[1]

    async def _idle(self, held: int) -> None:
        """Nothing to step: sleep until a submission or release (pending calls that do not fit, or whose request is
        not admitted, wait for a release)."""
        self._wakeup.clear()
        full = len(self._inflight) >= self.engine.max_batch_size
        if (held == len(self._pending) or full) and not self._releases and not self._chores:
            await self._wakeup.wait()

    async def _pass(self) -> tuple[str, int]:
        """Hand pending calls to the engine and run one step: ("stepped" or "idle", calls held back unadmitted)."""
        engine = self.engine
        room = engine.max_batch_size - len(self._inflight)
        if self._pending and (room < len(self._pending) or self._admitted is not None):
            # only some may go: the most urgent first, then the oldest request (stable: submission order after)
            self._pending = deque(sorted(self._pending, key=_urgency))
        if self._admitted is not None:
            self._admit_oldest()
        held: list[tuple[Invocation, asyncio.Future]] = []  # requests not admitted yet: they keep their place
        while self._pending and len(self._inflight) < engine.max_batch_size:
            inv, fut = self._pending.popleft()
            if fut.done():  # cancelled while queued
                continue
            if self._admitted is not None and inv.request_id not in self._admitted:
                held.append((inv, fut))
                continue
            try:
                engine.add(inv)
            except Exception as exc:  # this invocation's inputs broke the engine's intake: fail it alone
                log.debug("node %s: add failed for request %s", engine.node.name, inv.request_id, exc_info=True)
                fut.set_exception(NodeExecutionError(engine.node.name, inv.request_id, exc))
                continue  # (whatever add left in the engine goes when the failed request is released)
            self._inflight[id(inv)] = (inv, fut)
        if held:
            self._pending.extendleft(reversed(held))
        if not engine.has_work():
            return "idle", len(held)
        started = time.perf_counter()
        try:
            if self.inline or engine.answers_only():  # (answers found without a forward: no device-thread hop)
                results = engine.step()
            else:
                results = await run_on_device(asyncio.get_running_loop(), self.executor, engine.step)
        except Exception as exc:  # the whole step failed: fail what was in flight, keep serving
            log.exception("node %s: step failed", engine.node.name)
            self._fail_inflight(exc)
            return "failed", len(held)
        elapsed = time.perf_counter() - started
        self.steps += 1
        self.last_batch_size = len(results)
        self.last_step_seconds = elapsed
        self.step_seconds_total += elapsed
        self.invocations += len(results)
        for inv, out in results:
            entry = self._inflight.pop(id(inv), None)
            if entry is None:
                continue  # released meanwhile
            fut = entry[1]
            if fut.done():
                continue
            if isinstance(out, BaseException):
                fut.set_exception(NodeExecutionError(engine.node.name, inv.request_id, out))
            else:
                fut.set_result(out)
                if self._admitted is not None and inv.options.get("transfer") == "export":
                    # the request's state left with it (a per-walk move; the engine freed it): the place
                    # goes to the next request now, not when the request ends on the other worker
                    self._admitted.pop(inv.request_id, None)
                    if self._leads is not None:
                        self._leads.forget(inv.request_id)
        self._last_step_ok = True
        return ("stepped" if results else "empty"), len(held)

    def _fail_inflight(self, exc: BaseException) -> None:
        """Fail every invocation the engine holds and have it forget their requests before the next step."""
        failed = list(self._inflight.values())
        self._inflight.clear()
        for inv, fut in failed:
            if not fut.done():
                fut.set_exception(NodeExecutionError(self.engine.node.name, inv.request_id, exc))
            self._releases.add(inv.request_id)

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        for _, fut in list(self._pending) + list(self._inflight.values()) + list(self._chores):
            if not fut.done():
                fut.cancel()
        self._pending.clear()
        self._chores.clear()
        self._inflight.clear()
