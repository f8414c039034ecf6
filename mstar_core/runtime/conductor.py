"""The conductor: runs a request's walks over its env, node calls going through the schedulers.

Everything per request lives here (env, loop counters, stream buffers, which engines hold its state);
the graph objects are only read. One `Conductor` serves one loaded model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from mstar_core.errors import RequestError
from mstar_core.graph.graph import Graph
from mstar_core.graph.walk import (
    DynamicLoop,
    Loop,
    NodeCall,
    Parallel,
    Sequential,
    Step,
    StreamingGraphEdge,
    Walk,
    iter_calls,
)
from mstar_core.runtime.engine import Invocation
from mstar_core.runtime.request import Output
from mstar_core.runtime.scheduler import NodeScheduler

_STREAM_END = object()
_MISSING = object()


class Conductor:
    """Interprets walks for one model; `run(request_id, env, emit)` is one request's whole life."""

    def __init__(self, graph: Graph, schedulers: Mapping[str, NodeScheduler],
                 walk_schedulers: Mapping[tuple[str, str], NodeScheduler] | None = None):
        self.graph = graph
        self.schedulers = schedulers
        # (walk, node) -> scheduler, for nodes placed per walk (see `scheduler_for`)
        self.walk_schedulers = dict(walk_schedulers or {})
        # loops delegated to the worker that hosts all their nodes: id(loop) -> runner (see remote_loop.py)
        self.remote_loops: dict[int, Any] = {}
        # the consumer side of each streaming edge, as a call site of its own
        self._stream_calls: dict[int, NodeCall] = {
            id(edge): NodeCall(edge.dst_node, outputs=edge.outputs)
            for walk in graph.walks.values()
            for edge in walk.streams
        }
        # static node options overlaid with the call site's, once per call site (graphs are immutable)
        sites = [c for walk in graph.walks.values() for c in iter_calls(walk.body)] + list(self._stream_calls.values())
        self._call_options: dict[int, Mapping[str, Any]] = {
            id(c): {**graph.nodes[c.node].options, **c.options} if c.options else graph.nodes[c.node].options
            for c in sites
        }
        # the scheduler of every call site, once (a node placed per walk has one per walk); None for
        # nodes this conductor never calls itself (a worker's loop host only runs its own nodes)
        self._call_schedulers: dict[int, Any] = {
            id(c): self.walk_schedulers.get((walk.name, c.node)) or schedulers.get(c.node)
            for walk in graph.walks.values()
            for c in [*iter_calls(walk.body), *(self._stream_calls[id(e)] for e in walk.streams)]
        }

    def scheduler_for(self, walk: str, node: str) -> Any:
        """The scheduler `node`'s calls in `walk` go to."""
        return self.walk_schedulers.get((walk, node)) or self.schedulers[node]

    async def run(self, request_id: str, env: dict[str, Any], emit: Callable[[Output], None]) -> dict[str, Any]:
        state = RequestState(request_id, emit)
        try:
            for walk_name in self.graph.plan(env):
                await self._run_walk(state, self.graph.walks[walk_name], env)
            return env
        finally:
            for scheduler in state.visited.values():
                scheduler.release(request_id)

    # -- walks ---------------------------------------------------------------------------------

    async def _run_walk(self, state: RequestState, walk: Walk, env: dict[str, Any]) -> None:
        missing = [name for name in walk.inputs if name not in env]
        if missing:
            raise RequestError(f"walk '{walk.name}' needs inputs {missing}; got {sorted(env)}")
        frame = WalkFrame(walk, set(walk.emit))
        consumers = []
        for edge in walk.streams:
            stream = _Stream(edge, asyncio.Queue())
            frame.streams.setdefault(edge.src_node, []).append(stream)
            for out in self.graph.nodes[edge.dst_node].outputs:
                env[edge.outputs.get(out, out)] = []
            consumers.append(asyncio.ensure_future(self._consume(state, frame, stream, env)))
        if not consumers:
            await self._step(state, frame, walk.body, env)
            return
        body = asyncio.ensure_future(self._step(state, frame, walk.body, env))
        for task in (body, *consumers):
            task.add_done_callback(_retrieved)  # the first failure is raised; the others are its echoes
        try:
            # A consumer ends before the body only by failing (its worker died, its node raised): fail
            # the walk at once, which stops the producer too, instead of when the producer runs out.
            await asyncio.wait([body, *consumers], return_when=asyncio.FIRST_COMPLETED)
            if not body.done():
                for task in consumers:
                    if task.done():
                        task.result()  # raises the consumer's error
            await body
            for streams in frame.streams.values():
                for stream in streams:
                    for chunk in stream.state.close():
                        stream.queue.put_nowait(chunk)
                    stream.queue.put_nowait(_STREAM_END)
            await asyncio.gather(*consumers)
        finally:
            for task in (body, *consumers):
                if not task.done():
                    task.cancel()

    async def _consume(self, state: RequestState, frame: WalkFrame, stream: _Stream, env: dict[str, Any]) -> None:
        edge = stream.edge
        call = self._stream_calls[id(edge)]
        while True:
            chunk = await stream.queue.get()
            if chunk is _STREAM_END:
                return
            outputs = await self._invoke(state, call, env, {edge.dst_input: chunk})
            for port, value in outputs.items():
                name = edge.outputs.get(port, port)
                env[name].append(value)
                if name in frame.emit:
                    state.emit(Output(name, value, frame.walk.name))

    # -- steps ---------------------------------------------------------------------------------

    def after_call(self, state: RequestState, frame: WalkFrame, call: NodeCall, outputs: dict, env: dict) -> None:
        """Write a call's outputs to the env, emit what the walk emits, feed streaming edges.

        `outputs` may hold only some of the node's outputs (a delegated loop forwards just the
        emitted and streamed ones); undeclared keys an engine adds are ignored.
        """
        for port in self.graph.nodes[call.node].outputs:
            value = outputs.get(port, _MISSING)
            if value is _MISSING:
                continue
            name = call.env_output(port)
            env[name] = value
            if name in frame.emit:
                state.emit(Output(name, value, frame.walk.name))
        streams = frame.streams.get(call.node)
        if streams:
            for stream in streams:
                value = outputs.get(stream.edge.src_output, _MISSING)
                if value is not _MISSING and (stream.edge.keep is None or stream.edge.keep(value)):
                    for chunk in stream.state.push(value):
                        stream.queue.put_nowait(chunk)

    async def _step(self, state: RequestState, frame: WalkFrame, step: Step, env: dict[str, Any]) -> None:
        if isinstance(step, NodeCall):
            self.after_call(state, frame, step, await self._invoke(state, step, env), env)
        elif isinstance(step, Loop | DynamicLoop) and id(step) in self.remote_loops:
            await self.remote_loops[id(step)].run(self, state, frame, step, env)
        elif isinstance(step, Sequential):
            for sub in step.steps:
                await self._step(state, frame, sub, env)
        elif isinstance(step, Parallel):
            await self._parallel(state, frame, step, env)
        elif isinstance(step, Loop | DynamicLoop):
            await self.run_loop(state, frame, step, env)
        else:  # pragma: no cover - validated at build time
            raise TypeError(step)

    async def run_loop(self, state: RequestState, frame: WalkFrame, step: Loop | DynamicLoop, env: dict) -> None:
        """Run a loop here, its node calls going through this process's schedulers."""
        if isinstance(step, Loop):
            iters = env[step.iters] if isinstance(step.iters, str) else step.iters
            await self._loop(state, frame, step, env, int(iters), None)
        else:
            limit = step.max_iters
            if isinstance(limit, str):
                limit = env[limit]
            elif callable(limit):
                limit = limit(env)
            await self._loop(state, frame, step, env, int(limit), step.until)

    async def _loop(self, state, frame, loop: Loop | DynamicLoop, env, limit: int, until) -> None:
        accumulated = {name: [] for name in loop.accumulate}
        for i in range(limit):
            env[loop.index_name] = i
            await self._step(state, frame, loop.body, env)
            for name, values in accumulated.items():
                values.append(env[name])
            for out, into in loop.carry.items():
                env[into] = env[out]
            if until is not None and until(env):
                break
        env.pop(loop.index_name, None)
        for name, values in accumulated.items():
            env[loop.accumulate[name]] = values

    async def _parallel(self, state, frame, step: Parallel, env: dict[str, Any]) -> None:
        start = dict(env)
        branch_envs = [dict(env) for _ in step.branches]
        tasks = [
            asyncio.ensure_future(self._step(state, frame, branch, benv))
            for branch, benv in zip(step.branches, branch_envs, strict=True)
        ]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        # Only what a branch changed joins: a branch's untouched copy of a name another branch rewrote
        # (a Parallel inside a Loop, from the second iteration on) must not undo that rewrite.
        for benv in branch_envs:
            for name, value in benv.items():
                if name not in start or start[name] is not value:
                    env[name] = value

    async def _invoke(
        self, state: RequestState, call: NodeCall, env: dict[str, Any], given: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Call a node with its inputs read from the env (`given` supplies ports directly: a stream's chunk)."""
        node = self.graph.nodes[call.node]
        inputs = {port: env[call.env_input(port)] for port in node.inputs if not given or port not in given}
        for port in node.optional_inputs:
            name = call.env_input(port)
            if name in env:
                inputs[port] = env[name]
        if given:
            inputs.update(given)
        options = self._call_options[id(call)]
        scheduler = self._call_schedulers[id(call)]
        if state.holders.get(call.node) is not scheduler:  # first call, or a per-walk node changing workers
            await self.hold(state, call.node, scheduler)
        return await scheduler.submit(Invocation(state.request_id, call.node, inputs, options, self._count(state, call.node)))

    async def hold(self, state: RequestState, node: str, scheduler: Any) -> None:
        """Make `scheduler` the one holding the request's state for `node`, moving the state there if another held it.

        Only nodes placed per walk change holders: the old worker's engine exports the state
        (freeing it there), the new one imports it, before the request's next call runs.
        """
        held = state.holders.get(node)
        if held is scheduler:
            return
        state.holders[node] = scheduler
        state.visited[id(scheduler)] = scheduler  # released at the end, whatever happens mid-move
        if held is None:
            return
        out = await held.submit(Invocation(state.request_id, node, {}, {"transfer": "export"}, self._count(state, node)))
        await scheduler.submit(Invocation(state.request_id, node, {"state": out["state"]}, {"transfer": "import"},
                                          self._count(state, node)))

    @staticmethod
    def _count(state: RequestState, node: str) -> int:
        count = state.call_counts.get(node, 0)
        state.call_counts[node] = count + 1
        return count


def _retrieved(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


class RequestState:
    __slots__ = ("call_counts", "emit", "holders", "request_id", "visited")

    def __init__(self, request_id: str, emit: Callable[[Output], None]):
        self.request_id = request_id
        self.emit = emit
        self.holders: dict[str, Any] = {}  # node -> the scheduler whose engine holds this request's state
        self.visited: dict[int, Any] = {}  # every scheduler that held some of its state (released at the end)
        self.call_counts: dict[str, int] = {}


class WalkFrame:
    __slots__ = ("emit", "streams", "walk")

    def __init__(self, walk: Walk, emit: set[str]):
        self.walk = walk
        self.emit = emit
        self.streams: dict[str, list[_Stream]] = {}


class _Stream:
    __slots__ = ("edge", "queue", "state")

    def __init__(self, edge: StreamingGraphEdge, queue: asyncio.Queue):
        self.edge = edge
        self.queue = queue
        self.state = edge.policy.open()

