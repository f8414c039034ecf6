"""The conductor: runs a request's walks over its env, node calls going through the schedulers.

Everything per request lives here (env, loop counters, stream buffers, which engines hold its state);
the graph objects are only read. One `Conductor` serves one loaded model.

Each walk is compiled once into a tree of sites mirroring its steps (`sites.py`). Per-call data
(merged options, the scheduler, a delegated loop's runner) hangs off the site, i.e. off the
position of the step in the walk, never off the step object: the same `NodeCall` or loop object
used by two walks (or twice in one) is routed per use.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from mstar_core.errors import RequestError
from mstar_core.graph.graph import Graph
from mstar_core.graph.walk import DynamicLoop, Loop, NodeCall, StreamProgress, Walk
from mstar_core.runtime.engine import Invocation
from mstar_core.runtime.request import Output
from mstar_core.runtime.sites import (
    AssignSite,
    CallSite,
    LoopSite,
    ParallelSite,
    SequenceSite,
    Site,
    WalkSites,
    compile_walk,
)
from mstar_core.runtime.streams import RequestStream

_MISSING = object()
_PLAIN_OPTION = (str, int, float, bool, type(None))


class Conductor:
    """Interprets walks for one model; `run(request_id, env, emit)` is one request's whole life."""

    def __init__(self, graph: Graph, schedulers: Mapping[str, Any],
                 walk_schedulers: Mapping[tuple[str, str], Any] | None = None):
        self.graph = graph
        self.schedulers = schedulers
        # (walk, node) -> scheduler, for nodes placed per walk (see `scheduler_for`)
        self.walk_schedulers = dict(walk_schedulers or {})
        # loops delegated to the worker that hosts all their nodes: (walk, loop index) -> runner (remote_loop.py)
        self.remote_loops: dict[tuple[str, int], Any] = {}
        # streams whose items go worker to worker: walk -> stream index -> plan (remote_stream.py)
        self.direct_streams: dict[str, dict[int, Any]] = {}
        # every walk compiled once: each call site with its options and scheduler, by position
        self.sites: dict[str, WalkSites] = {
            name: compile_walk(graph, walk, self._site_scheduler) for name, walk in graph.walks.items()
        }

    def _site_scheduler(self, walk: str, node: str) -> Any:
        # None for nodes this conductor never calls itself (a worker's loop host only runs its own nodes)
        return self.walk_schedulers.get((walk, node)) or self.schedulers.get(node)

    def scheduler_for(self, walk: str, node: str) -> Any:
        """The scheduler `node`'s calls in `walk` go to."""
        return self.walk_schedulers.get((walk, node)) or self.schedulers[node]

    async def run(self, request_id: str, env: dict[str, Any], emit: Callable[[Output], None],
                  walks: list[str] | None = None, credit: Callable[[], Awaitable[None]] | None = None,
                  plan: list[str] | None = None, priority: float = 0.0) -> dict[str, Any]:
        """Run the request's plan over `env`; each walk's name is appended to `walks` as it starts.

        `credit`, awaited before each node call, holds the request back while its reader lags (backpressure).
        `plan`: the walks the submitter already planned and checked (`AsyncEngine.submit`); None plans here.
        `priority`: the request's own, added to each call's (`engine.BACKGROUND_PRIORITY` for work that may wait).
        """
        state = RequestState(request_id, emit, credit, priority)
        try:
            todo = deque(self.graph.plan(env) if plan is None else plan)
            while todo:
                name = todo.popleft()
                if walks is not None:
                    walks.append(name)
                await self._run_walk(state, self.sites[name], env)
                try:
                    todo.extendleft(reversed(self.graph.next_walks(name, env)))
                except KeyError as exc:  # the model's branch chose a walk it did not declare: its bug, not the client's
                    raise RequestError(exc.args[0], status=500) from None
            return env
        finally:
            for scheduler in state.visited.values():
                scheduler.release(request_id)

    # -- walks ---------------------------------------------------------------------------------

    async def _run_walk(self, state: RequestState, sites: WalkSites, env: dict[str, Any]) -> None:
        walk = sites.walk
        missing = [name for name in walk.inputs if name not in env]
        if missing:
            raise RequestError(f"walk '{walk.name}' needs inputs {missing}; got {sorted(env)}")
        # an earlier walk's value under a name this walk writes itself is no optional input of this walk
        hidden = {name: env.pop(name) for name in sites.scoped if name in env}
        try:
            await self._run_walk_body(state, sites, env)
        finally:
            for name, value in hidden.items():  # what this walk did not rewrite stays as the earlier walk left it
                env.setdefault(name, value)

    async def _run_walk_body(self, state: RequestState, sites: WalkSites, env: dict[str, Any]) -> None:
        walk = sites.walk
        frame = WalkFrame(walk, set(walk.emit))
        if not walk.streams:
            await self._step(state, frame, sites.body, env)
            return
        started = time.monotonic()
        plans = self.direct_streams.get(walk.name, {})
        streams: list[Any] = []
        for k, edge in enumerate(walk.streams):
            stream = plans[k].open(state.request_id) if k in plans else None
            if stream is not None:  # its producer's worker sends the items to its consumer's (remote_stream.py)
                frame.routes[k] = stream
            else:
                stream = RequestStream(edge, started)
                frame.streams.setdefault(edge.src_node, []).append(stream)
            streams.append(stream)
        for stream in streams:
            if stream.edge.consumer is None:
                for out in self.graph.nodes[stream.edge.dst_node].outputs:
                    env[stream.edge.outputs.get(out, out)] = []
        entry = dict(env)  # what consumer fragments start from: the walk's inputs, never the body's progress

        async def body() -> None:
            await self._step(state, frame, sites.body, env)
            for k in sites.closes[None]:
                streams[k].close()

        async def consumer(k: int) -> None:
            stream = streams[k]
            if k in frame.routes:
                await stream.consume(self, state, frame, env, entry)
            elif stream.edge.consumer is None:
                await self._consume(state, frame, stream, sites.stream_calls[k], env)
            else:
                cenv = dict(entry)
                await self._step(state, frame.fragment({stream.edge.into: stream}), sites.consumers[k], cenv)
                stream.finish_reading()
                for name, value in cenv.items():  # the fragment's outputs join the walk's env
                    if name != stream.edge.into and (name not in entry or entry[name] is not value):
                        env[name] = value
            for j in sites.closes[k]:
                streams[j].close()

        tasks = [asyncio.ensure_future(body()), *(asyncio.ensure_future(consumer(k)) for k in range(len(streams)))]
        for task in tasks:
            task.add_done_callback(_retrieved)  # the first failure is raised; the others are its echoes
        try:
            # A stage that fails (its worker died, its node raised) fails the walk at once, which stops
            # every other stage too, instead of when the producer runs out.
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in tasks:
                if task in done and not task.cancelled() and task.exception() is not None:
                    task.result()
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()

    async def _consume(self, state: RequestState, frame: WalkFrame, stream: RequestStream, site: CallSite,
                       env: dict[str, Any]) -> None:
        """A per-chunk consumer: one call of its node per released chunk; outputs collected as lists."""
        edge = stream.edge
        while True:
            chunk = await stream.next_chunk()
            if chunk is None:
                return
            self.collect(state, frame, site, edge, env, await self._invoke(state, frame, site, env,
                                                                         {edge.dst_input: chunk}))

    def collect(self, state: RequestState, frame: WalkFrame, site: CallSite, edge: Any, env: dict[str, Any],
                outputs: Mapping[str, Any]) -> None:
        """One per-chunk consumer call's outputs: appended to the env's lists, emitted, fed on (also from a worker)."""
        for port, value in outputs.items():
            name = edge.outputs.get(port, port)
            if name not in env or port not in self.graph.nodes[site.node].outputs:
                continue
            env[name].append(value)
            if name in frame.emit:
                state.emit(Output(name, value, frame.walk.name, frame.branch))
        self._feed(frame, site.node, outputs)

    # -- steps ---------------------------------------------------------------------------------

    def after_call(self, state: RequestState, frame: WalkFrame, call: NodeCall, outputs: dict, env: dict,
                   site: CallSite | None = None) -> None:
        """Write a call's outputs to the env, emit what the walk emits, feed streaming edges.

        `outputs` may hold only some of the node's outputs (a delegated loop forwards just the
        emitted and streamed ones); undeclared keys an engine adds are ignored.
        """
        wiring = site.outputs if site is not None else [(p, call.env_output(p)) for p in self.graph.nodes[call.node].outputs]
        emit = frame.emit
        for port, name in wiring:
            value = outputs.get(port, _MISSING)
            if value is _MISSING:
                continue
            env[name] = value
            if name in emit:
                state.emit(Output(name, value, frame.walk.name, frame.branch))
        if frame.streams:
            self._feed(frame, call.node, outputs)

    @staticmethod
    def _feed(frame: WalkFrame, node: str, outputs: Mapping[str, Any]) -> None:
        for stream in frame.streams.get(node, ()):
            value = outputs.get(stream.src_output, _MISSING)
            if value is not _MISSING:
                stream.push(value)

    async def _step(self, state: RequestState, frame: WalkFrame, site: Site, env: dict[str, Any]) -> None:
        if isinstance(site, CallSite):
            self.after_call(state, frame, site.call, await self._invoke(state, frame, site, env), env, site)
        elif isinstance(site, AssignSite):
            self._assign(state, frame, site, env)
        elif isinstance(site, SequenceSite):
            for sub in site.steps:
                await self._step(state, frame, sub, env)
        elif isinstance(site, ParallelSite):
            await (self._fan_out(state, frame, site, env) if site.spec.fan_out else
                   self._parallel(state, frame, site, env))
        elif isinstance(site, LoopSite):
            runner = self.remote_loops.get((site.walk, site.index))
            if runner is not None:
                await runner.run(self, state, frame, site, env)
            else:
                await self.run_loop(state, frame, site, env)
        else:  # pragma: no cover - compiled from validated walks
            raise TypeError(site)

    @staticmethod
    def _assign(state: RequestState, frame: WalkFrame, site: AssignSite, env: dict[str, Any]) -> None:
        """Copy (or move) env values to other names; every source is read before any target is written."""
        names = site.spec.names
        values = {dst: env[src] for dst, src in names.items()}
        if site.spec.move:
            for src in set(names.values()) - set(names):
                env.pop(src, None)
        env.update(values)
        for dst, value in values.items():
            if dst in frame.emit:
                state.emit(Output(dst, value, frame.walk.name, frame.branch))

    async def run_loop(self, state: RequestState, frame: WalkFrame, site: LoopSite, env: dict) -> None:
        """Run a loop here, its node calls going through this process's schedulers."""
        step = site.spec
        if isinstance(step, Loop):
            iters = env[step.iters] if isinstance(step.iters, str) else step.iters
            await self._loop(state, frame, site, env, int(iters), None)
        else:
            limit = step.max_iters
            if isinstance(limit, str):
                limit = env[limit]
            elif callable(limit):
                limit = limit(env)
            await self._loop(state, frame, site, env, int(limit), step.until)

    async def _loop(self, state, frame, site: LoopSite, env, limit: int, until) -> None:
        loop: Loop | DynamicLoop = site.spec
        accumulated = {name: [] for name in loop.accumulate}
        fed_by = [frame.takes[name] for name in site.reads if name in frame.takes]
        segmented = [s for streams in frame.streams.values() for s in streams
                     if s.edge.segment_by == loop.index_name] if frame.streams else []
        for i in range(limit):
            env[loop.index_name] = i
            await self._step(state, frame, site.body, env)
            for stream in segmented:  # one segment per iteration (e.g. one utterance): its tail goes out now
                stream.end_segment()
            for name, values in accumulated.items():
                values.append(env[name])
            for out, into in loop.carry.items():
                env[into] = env[out]
            if until is not None and until(env) and (not fed_by or await _drained(fed_by)):
                break
        env.pop(loop.index_name, None)
        for name, values in accumulated.items():
            env[loop.accumulate[name]] = values

    async def _parallel(self, state, frame, site: ParallelSite, env: dict[str, Any]) -> None:
        start = dict(env)
        branch_envs = [dict(env) for _ in site.branches]
        await _gather_all(self._step(state, frame, branch, benv)
                          for branch, benv in zip(site.branches, branch_envs, strict=True))
        # Only what a branch changed joins: a branch's untouched copy of a name another branch rewrote
        # (a Parallel inside a Loop, from the second iteration on) must not undo that rewrite.
        for benv in branch_envs:
            for name, value in benv.items():
                if name not in start or start[name] is not value:
                    env[name] = value

    async def _fan_out(self, state, frame, site: ParallelSite, env: dict[str, Any]) -> None:
        spec = site.spec
        count = env[spec.count] if isinstance(spec.count, str) else spec.count
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise RequestError(f"walk '{frame.walk.name}': Parallel count '{spec.count}' must be an int >= 0, "
                               f"got {count!r}")
        branch_envs = [{**env, spec.index_name: i} for i in range(count)]
        await _gather_all(self._step(state, frame.branch_frame(i), site.branches[0], benv)
                          for i, benv in enumerate(branch_envs))
        if spec.collect is not None:
            names = dict(spec.collect)
        else:
            names = {}
            for benv in branch_envs:
                for name, value in benv.items():
                    if name != spec.index_name and (name not in env or env[name] is not value):
                        names.setdefault(name, name)
        for name, into in names.items():
            env[into] = [benv.get(name) for benv in branch_envs]

    async def _invoke(self, state: RequestState, frame: WalkFrame, site: CallSite, env: dict[str, Any],
                      given: dict[str, Any] | None = None) -> dict[str, Any]:
        """Call a node with its inputs read from the env (`given` supplies ports directly: a stream's chunk).

        An input whose env name is a stream this fragment takes from takes the stream's next chunk.
        """
        if state.credit is not None:
            await state.credit()  # a reader far behind: produce no more until it catches up
        inputs = {}
        for port, name in site.inputs:
            if given and port in given:
                continue
            stream = frame.takes.get(name) if frame.takes else None
            if stream is not None:
                env[name] = await stream.take()
            inputs[port] = env[name]
        for port, name in site.optional_inputs:
            if name in env:
                inputs[port] = env[name]
        if given:
            inputs.update(given)
        options = site.options
        if site.dynamic:
            options = {**options, **{key: _option_value(site, key, ref.resolve(env)) for key, ref in site.dynamic}}
        priority, lead = state.priority, None
        if site.prioritised and frame.streams:
            now = time.monotonic()
            ranked = [(s.edge.priority, s.progress(now)) for fed in frame.streams.values() for s in fed
                      if s.edge.ranks(site.node)]
            priority += float(max(rank(progress) for rank, progress in ranked)) if ranked else 0.0
            lead = _lead(ranked)
        scheduler = site.scheduler
        if state.holders.get(site.node) is not scheduler:  # first call, or a per-walk node changing workers
            await self.hold(state, site.node, scheduler)
        return await scheduler.submit(Invocation(state.request_id, site.node, inputs, options,
                                                 self._count(state, site.node), priority, state.arrival, lead))

    async def hold(self, state: RequestState, node: str, scheduler: Any) -> None:
        """Make `scheduler` the one holding the request's state for `node`, moving the state there if another held it.

        Only nodes placed per walk change holders: the old worker's engine exports the state
        (freeing it there), the new one imports it, before the request's next call runs. Between two
        workers the state goes straight from one to the other (`Cluster.move_state`).
        """
        # Calls of one request can race here (the branches of a fan-out reaching a per-walk node at
        # once): the first moves the state, the others wait for it to arrive before they call.
        async with state.move_locks.setdefault(node, asyncio.Lock()):
            held = state.holders.get(node)
            if held is scheduler:
                return
            state.visited[id(scheduler)] = scheduler  # released at the end, whatever happens mid-move
            if held is not None:
                await self._move(state, node, held, scheduler)
            state.holders[node] = scheduler  # only once the state is there: a racing call waits above

    async def _move(self, state: RequestState, node: str, held: Any, scheduler: Any) -> None:
        export_index, import_index = self._count(state, node), self._count(state, node)
        cluster = getattr(held, "cluster", None)  # both on workers: the state goes straight from one to the other
        if cluster is not None and getattr(scheduler, "cluster", None) is cluster and \
                await cluster.move_state(held, scheduler, state.request_id, node, export_index, import_index,
                                         arrival=state.arrival):
            return
        out = await held.submit(Invocation(state.request_id, node, {}, {"transfer": "export"}, export_index,
                                           arrival=state.arrival))
        await scheduler.submit(Invocation(state.request_id, node, {"state": out["state"]}, {"transfer": "import"},
                                          import_index, arrival=state.arrival))

    @staticmethod
    def _count(state: RequestState, node: str) -> int:
        count = state.call_counts.get(node, 0)
        state.call_counts[node] = count + 1
        return count


def _option_value(site: CallSite, key: str, value: Any) -> Any:
    if not isinstance(value, _PLAIN_OPTION):
        raise RequestError(f"call option '{key}' of node '{site.node}' (from the env) must be a str, int, float, "
                           f"bool or None, got {type(value).__name__}", status=500)
    return value


async def _drained(streams: list[RequestStream]) -> bool:
    """Whether every stream a loop reads is drained; waits for a chunk or the producer's end to know."""
    for stream in streams:
        await stream.wait_ready_or_closed()
    return all(s.drained for s in streams)


async def _gather_all(coros) -> None:
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise


def _lead(ranked: list[tuple[Any, StreamProgress]]) -> float | None:
    """The listener's lead over a call's ranked streams: the one furthest behind; None until every one of them
    plays (or where a priority function tells no lead: only `StreamPriority` and its like have a `lead`)."""
    leads = [rank.lead(progress) if hasattr(rank, "lead") else None for rank, progress in ranked]
    if not leads or None in leads:
        return None
    return min(leads)


def _retrieved(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


class RequestState:
    __slots__ = ("arrival", "call_counts", "credit", "emit", "holders", "move_locks", "priority", "request_id",
                 "visited")

    def __init__(self, request_id: str, emit: Callable[[Output], None],
                 credit: Callable[[], Awaitable[None]] | None = None, priority: float = 0.0):
        self.request_id = request_id
        self.priority = priority  # the request's class, under each call's stream priority (see `Conductor.run`)
        self.arrival = time.monotonic()  # every call carries it: schedulers serve older requests first
        self.emit = emit
        self.credit = credit
        self.holders: dict[str, Any] = {}  # node -> the scheduler whose engine holds this request's state
        self.visited: dict[int, Any] = {}  # every scheduler that held some of its state (released at the end)
        self.call_counts: dict[str, int] = {}
        self.move_locks: dict[str, asyncio.Lock] = {}  # node -> held while its state moves between workers


class WalkFrame:
    """One walk's run for one request: what it emits, the streams its nodes feed, the streams a fragment takes,
    and the dynamic fan-out branch it runs in (None outside one; what its emitted outputs carry).

    `branches` is the path of fan-out indices down to this frame (nested fan-outs): with the loop's
    index it names one running copy of a loop, which is how a delegated loop is keyed on the wire.
    """

    __slots__ = ("branch", "branches", "emit", "routes", "streams", "takes", "walk")

    def __init__(self, walk: Walk, emit: set[str]):
        self.walk = walk
        self.emit = emit
        self.streams: dict[str, list[RequestStream]] = {}
        self.takes: dict[str, RequestStream] = {}
        # stream index -> its route worker to worker (remote_stream.DirectStream): fed by a delegated loop, not here
        self.routes: dict[int, Any] = {}
        self.branch: int | None = None
        self.branches: tuple[int, ...] = ()

    def branch_frame(self, index: int) -> WalkFrame:
        """The frame of fan-out branch `index`: the same walk, streams and takes; its outputs carry `index`."""
        child = WalkFrame(self.walk, self.emit)
        child.streams, child.takes, child.branch = self.streams, self.takes, index
        child.routes = self.routes
        child.branches = (*self.branches, index)
        return child

    def fragment(self, takes: dict[str, RequestStream]) -> WalkFrame:
        """The frame of a consumer fragment: the same walk and streams, taking chunks from `takes`."""
        child = WalkFrame(self.walk, self.emit)
        child.streams = self.streams
        child.routes = self.routes
        child.takes = takes
        child.branch, child.branches = self.branch, self.branches
        return child

    @property
    def branch_key(self) -> str:
        """`branches` as a wire string: '' outside a fan-out, '2' in branch 2, '2.0' in branch 0 of a fan-out inside it."""
        return ".".join(map(str, self.branches))
