"""Walk composition primitives: NodeCall, Sequential, Parallel, Loop, DynamicLoop, Walk.

Data flows by name: a walk runs over an environment (name -> value). A node call reads its
inputs from the environment (renamed by `inputs`) and writes its outputs back (renamed by
`outputs`). All of these are immutable specs; per-request state lives in the runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Union

import attrs

from mstar_core.graph.node import _frozen_mapping, _str_tuple, parse_port
from mstar_core.streaming.policies import ChunkPolicy


@attrs.frozen
class NodeCall:
    """Invoke one node. `inputs` maps node input -> env name; `outputs` maps node output -> env name.

    An optional input mapped to None is never taken by this call, even where the walk has a value
    under the input's own name (e.g. a prompt write of a sampling node: `inputs={"sampling": None}`).
    """

    node: str
    inputs: Mapping[str, str | None] = attrs.field(factory=dict, converter=_frozen_mapping)
    outputs: Mapping[str, str] = attrs.field(factory=dict, converter=_frozen_mapping)
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping)

    def env_input(self, name: str) -> str | None:
        """The env name input `name` reads (None: this call leaves that optional input out)."""
        return self.inputs.get(name, name)

    def env_output(self, name: str) -> str:
        return self.outputs.get(name, name)


@attrs.frozen
class FromEnv:
    """A call option whose value comes from the request's env when the call runs.

    `NodeCall("lm", options={"cache_label": FromEnv("loop_index", "step{}")})` passes
    `cache_label="step3"` on the fourth iteration. `derive` is a format string (`str.format` of the
    env value) or a callable of it; without it the value is passed as is. The name must be available
    where the call runs (checked at build); the derived value must be a plain value (str, int,
    float, bool or None), checked at run time.
    """

    name: str
    derive: str | Callable[[Any], Any] | None = attrs.field(default=None, eq=False)

    def resolve(self, env: Mapping[str, Any]) -> Any:
        value = env[self.name]
        if isinstance(self.derive, str):
            return self.derive.format(value)
        if self.derive is not None:
            return self.derive(value)
        return value


@attrs.frozen(init=False)
class Assign:
    """Copy env values to other names, without a node: `Assign({"dst": "src"})` or `Assign(dst="src")`.

    Every source is read before any target is written (so `Assign(a="b", b="a")` swaps). With
    `move=True` (see `Rename`) the sources are dropped afterwards, unless also a target. Checked at
    build: each source must be available where the step runs, and a target may not already be
    (that would silently replace a value) unless `replace=True`. Typical uses: two `Parallel`
    branches running the same fragment each rename its result to their own name; a value copied
    before a loop overwrites it.
    """

    names: Mapping[str, str]
    move: bool = False
    replace: bool = False

    def __init__(self, names: Mapping[str, str] | None = None, /, *, move: bool = False, replace: bool = False,
                 **kw: str):
        merged = {**(names or {}), **kw}
        if not merged:
            raise ValueError("Assign needs at least one target: Assign(dst='src') or Assign({'dst': 'src'})")
        bad = [f"{k}={v!r}" for k, v in merged.items() if not (isinstance(k, str) and isinstance(v, str) and k and v)]
        if bad:
            raise ValueError(f"Assign maps env names to env names (non-empty strings), got {', '.join(bad)}")
        self.__attrs_init__(_frozen_mapping(merged), move, replace)

    @property
    def label(self) -> str:
        """How drawings and errors show it: `Copy y = x` or `Rename y = x`."""
        return f"{'Rename' if self.move else 'Copy'} " + ", ".join(f"{dst} = {src}" for dst, src in self.names.items())


def Rename(names: Mapping[str, str] | None = None, /, *, replace: bool = False, **kw: str) -> Assign:
    """`Assign(..., move=True)`: the value under each source name now lives under its target name only."""
    return Assign(names, move=True, replace=replace, **kw)


def Copy(names: Mapping[str, str] | None = None, /, *, replace: bool = False, **kw: str) -> Assign:
    """`Assign(...)`: the value under each source name is also under its target name."""
    return Assign(names, replace=replace, **kw)


def _accumulate_map(value: Any) -> Mapping[str, str]:
    """`accumulate` is names (each list stored under the same name) or a map name -> list name."""
    if isinstance(value, Mapping):
        return _frozen_mapping(value)
    return _frozen_mapping({name: name for name in _str_tuple(value)})


def _as_step(step: Any) -> Step:
    if isinstance(step, str):
        return NodeCall(step)
    if isinstance(step, NodeCall | Assign | Sequential | Parallel | Loop | DynamicLoop):
        return step
    raise TypeError(f"a walk step must be a node name or a primitive, got {type(step).__name__}: {step!r}")


def _as_steps(steps: Any) -> tuple[Step, ...]:
    return tuple(_as_step(s) for s in steps)


@attrs.frozen(init=False)
class Sequential:
    """Run steps in order; each sees what the earlier ones wrote."""

    steps: tuple[Step, ...]

    def __init__(self, *steps: Any):
        self.__attrs_init__(_as_steps(steps))


@attrs.frozen(init=False)
class Parallel:
    """Fan out: branches run concurrently on the same inputs; their outputs are joined by name.

    Each branch works on its own copy of the env; at the join only the names a branch wrote come
    back, so branches must write different names (checked at build).

    Dynamic fan-out: `Parallel(body, count="n", index_name="choice")` runs `count` copies of one
    `body` side by side (`count` is an int or the env name of an int), each with its index under
    `index_name` in its env. Every name the body writes comes back as a list with one value per
    branch, in branch order; `collect` keeps only some of them (names, or a map name -> list name).
    With call options read from the env, branches can e.g. decode `n` forks of a prompt's cache:
    `NodeCall("lm", options={"cache_label": FromEnv("choice", "choice{}"), "fork_from": "main"})`.
    """

    branches: tuple[Step, ...]
    count: int | str | None = None
    index_name: str = "branch_index"
    collect: Mapping[str, str] | None = None

    def __init__(self, *branches: Any, count: int | str | None = None, index_name: str = "branch_index",
                 collect: Any = None):
        if count is not None and len(branches) != 1:
            raise ValueError(f"Parallel(count=...) takes exactly one body to fan out, got {len(branches)} branches")
        self.__attrs_init__(_as_steps(branches), count, index_name,
                            None if collect is None else _accumulate_map(collect))

    @property
    def fan_out(self) -> bool:
        return self.count is not None


@attrs.frozen(kw_only=True)
class Loop:
    """Run `body` a fixed number of times.

    `iters` is an int or the env name of an int. `carry` maps an output name of one iteration to
    the input name it feeds in the next. `accumulate` collects per-iteration values into lists:
    names (the list replaces the value under the same name after the loop) or a map
    name -> list name. The env name `loop_index` holds the iteration.
    """

    body: Step = attrs.field(converter=_as_step)
    iters: int | str
    carry: Mapping[str, str] = attrs.field(factory=dict, converter=_frozen_mapping)
    accumulate: Mapping[str, str] = attrs.field(factory=dict, converter=_accumulate_map)
    index_name: str = "loop_index"


@attrs.frozen(kw_only=True)
class DynamicLoop:
    """Run `body` until `until(env)` is true for this request, or `max_iters` iterations.

    `until` is evaluated after each iteration on the request's env. `max_iters` is an int, the env
    name of an int, or a callable of the env. Carry and accumulate work as in `Loop`.
    """

    body: Step = attrs.field(converter=_as_step)
    until: Callable[[Mapping[str, Any]], bool] | None
    max_iters: int | str | Callable[[Mapping[str, Any]], int] | None
    carry: Mapping[str, str] = attrs.field(factory=dict, converter=_frozen_mapping)
    accumulate: Mapping[str, str] = attrs.field(factory=dict, converter=_accumulate_map)
    index_name: str = "loop_index"


Step = Union[NodeCall, Assign, Sequential, Parallel, Loop, DynamicLoop]  # noqa: UP007 (forward refs)


@attrs.frozen
class StreamProgress:
    """What a streaming edge has done for one request so far (what a priority function reads).

    `items`: items pushed into the stream (after `keep`); `released`: items released to the
    consumer in chunks (each counted once); `chunks`: chunks released; `started`: when the walk
    started; `first_release`: when the first chunk was released (None before); `now`: the time of
    the reading. Times are `time.monotonic()` seconds.
    """

    items: int
    released: int
    chunks: int
    started: float
    first_release: float | None
    now: float

    def seconds_ahead(self, per_item: float = 0.0, per_chunk: float = 0.0) -> float:
        """Media released to the listener minus media played so far, in seconds (negative: it has run dry).

        Released media is `per_item` seconds per released item plus `per_chunk` per chunk (a windowed
        decoder emits a fixed slice per window). Playback starts with the first released chunk and
        runs in real time; before it, the listener has been waiting since the walk started, which
        counts as time behind.
        """
        if self.first_release is None:
            return -(self.now - self.started)
        return self.released * per_item + self.chunks * per_chunk - (self.now - self.first_release)


def _optional_step(step: Any) -> Step | None:
    return None if step is None else _as_step(step)


@attrs.frozen
class StreamingGraphEdge:
    """Feed `src` ('node.output', produced repeatedly inside the walk) to a consumer while it runs.

    Two kinds of consumer:

    - `dst='node.input'`: one call of that node per chunk the `policy` forms; the call's other
      inputs come from the env, its outputs are collected as lists in the env (and may feed
      further streams).
    - `consumer=<walk fragment>` with `into='name'`: the fragment (e.g. a `DynamicLoop` on an AR
      node) starts with the walk and runs concurrently with the producer, on its own copy of the
      walk's inputs. A call in it that reads env name `into` takes the next released chunk,
      waiting while none is ready; once the producer has finished and every chunk was taken, it
      gets an empty chunk with `final=True` (the last real chunk is marked final when that is
      known at the time it is taken). A loop reading the stream ends when its `until` holds
      *and* the stream is drained: it waits for the next chunk or the producer's end before it
      decides, so no item is lost or read twice. The fragment's outputs join the env when it ends.
      Its calls may produce further streams (producer -> consumer -> consumer').

    Items may be anything (token ids, a hidden-state row per token, a codec frame per step); items
    for which `keep(value)` is false are not part of the stream. `priority`, a function of the
    request's `StreamProgress`, gives the producer's calls a priority (larger runs first in engines
    that order by `Invocation.priority`); see `stream_priority` for the usual one. `fed_by` names the other
    nodes whose calls make the producer's items (a loop of engine calls ending in a function node that emits
    them): they take the stream's priority too, since ranking only the cheap last call would not speed it up.

    `segment_by`: the `index_name` of a loop of the walk that the producer runs in, one segment of the stream per
    iteration (one utterance per sentence a TTS speaks): at the end of each iteration the policy releases the
    segment's tail as at the producer's end and starts the next afresh (`ChunkStream.end_segment`).
    """

    src: str
    dst: str | None = None
    policy: ChunkPolicy | None = None
    keep: Callable[[Any], bool] | None = attrs.field(default=None, eq=False)
    outputs: Mapping[str, str] = attrs.field(factory=dict, converter=_frozen_mapping)
    into: str | None = None
    consumer: Step | None = attrs.field(default=None, converter=_optional_step)
    priority: Callable[[StreamProgress], float] | None = attrs.field(default=None, eq=False)
    fed_by: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    segment_by: str | None = None

    def ranks(self, node: str) -> bool:
        """Whether `node`'s calls take this stream's priority."""
        return self.priority is not None and (node == self.src_node or node in self.fed_by)

    @property
    def src_node(self) -> str:
        return parse_port(self.src, "StreamingGraphEdge.src")[0]

    @property
    def src_output(self) -> str:
        return parse_port(self.src, "StreamingGraphEdge.src")[1]

    @property
    def dst_node(self) -> str | None:
        return None if self.dst is None else parse_port(self.dst, "StreamingGraphEdge.dst")[0]

    @property
    def dst_input(self) -> str | None:
        return None if self.dst is None else parse_port(self.dst, "StreamingGraphEdge.dst")[1]

    @property
    def name(self) -> str:
        """How errors and drawings name the edge."""
        return f"{self.src} -> {self.dst or self.into}"


def stream_priority(per_item: float = 0.0, per_chunk: float = 0.0, horizon: float = 30.0,
                    start_lead: float = 0.0) -> StreamPriority:
    """The producer's priority = how close the listener is to running dry (seconds behind; larger = sooner).

    `per_item` / `per_chunk`: seconds of media per released item / chunk (see
    `StreamProgress.seconds_ahead`). A stream far ahead of its listener yields to one about to
    stall; time itself makes every stream more urgent as its lead is played away, so none is
    starved by another. Calls without a priority stay at 0, i.e. level with a stream exactly at
    the edge of running dry. Clamped to +-`horizon`.

    `start_lead`: before its first chunk a stream counts as `start_lead` seconds ahead, less the
    time it has waited (a listener who has heard nothing cannot hear a gap, only a later start).
    With 0 a waiting stream outranks every playing one with audio queued, so under overload every
    arrival starts and then all run dry together; with a lead, a new stream starts once the playing
    ones are that far ahead of their listeners, or once it has waited that long when it next submits.

    The priority is computed when a call is submitted; a call keeps it while it queues. Re-ranking
    queued calls as they wait (earliest deadline first) was measured worse under overload: after
    `start_lead` every waiting stream outranks every playing one, all start, all run dry.

    The returned object also tells the listener's lead (`StreamPriority.lead`), which the runtime stamps on each
    ranked call (`Invocation.lead`) for the node setting `admit_streams`.
    """
    return StreamPriority(per_item, per_chunk, horizon, start_lead)


@attrs.frozen
class StreamPriority:
    """`stream_priority`'s ranking (call it with a `StreamProgress`) and the listener's lead it is based on."""

    per_item: float = 0.0
    per_chunk: float = 0.0
    horizon: float = 30.0
    start_lead: float = 0.0

    def __call__(self, progress: StreamProgress) -> float:
        if progress.first_release is None:
            behind = progress.now - progress.started - self.start_lead
        else:
            behind = -progress.seconds_ahead(self.per_item, self.per_chunk)
        return max(-self.horizon, min(self.horizon, behind))

    def lead(self, progress: StreamProgress) -> float | None:
        """Seconds of media made for the listener beyond what has played (None before playback starts).

        Unlike the ranking this counts the items made but not yet released in a chunk (at the media per item the
        released chunks showed), so it moves smoothly with production instead of by whole windows: its slope is
        the stream's speed over real time, less one.
        """
        if progress.first_release is None or progress.released == 0:
            return None
        released = progress.released * self.per_item + progress.chunks * self.per_chunk
        made = released * progress.items / progress.released
        return made - (progress.now - progress.first_release)


@attrs.frozen(kw_only=True)
class Walk:
    """A named phase of a model's behaviour.

    `inputs` are the env names the walk needs on entry; `optional_inputs` names the request (or an
    earlier walk of the plan) may supply or leave out. A node's optional input is taken only from
    the walk's own scope: its call's mapping, or a name this walk declares or one of its steps
    produces; a value an earlier walk left in the env under another name is never read, and an
    optional input the walk cannot supply is simply left out. `outputs` are the names it guarantees
    on exit.
    `emit` names values streamed to the caller as soon as they are produced (by body nodes or by
    streaming consumers). A streaming consumer's outputs are also collected as lists in the env.
    """

    name: str
    body: Step = attrs.field(converter=_as_step)
    inputs: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    optional_inputs: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    outputs: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    emit: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    streams: tuple[StreamingGraphEdge, ...] = attrs.field(default=(), converter=tuple)
    description: str = ""


def walk_steps(walk: Walk):
    """The walk's body, then each streaming consumer fragment: every step that runs in the walk."""
    yield walk.body
    for edge in walk.streams:
        if edge.consumer is not None:
            yield edge.consumer


def iter_walk_calls(walk: Walk):
    """Every NodeCall of a walk: its body's, then its streaming consumer fragments'."""
    for step in walk_steps(walk):
        yield from iter_calls(step)


def iter_calls(step: Step):
    """Yield every NodeCall inside a step, depth first, in program order."""
    for leaf in iter_leaves(step):
        if isinstance(leaf, NodeCall):
            yield leaf


def children(step: Step) -> tuple[Step, ...]:
    """The steps directly inside `step`, in program order: the one traversal every walk tree uses.

    A Sequential's steps, a Parallel's branches (one body for a fan-out), a loop's body; none for a
    NodeCall or an Assign. Child i of a step at position `path` is at `(*path, i)` (see `graph.Path`).
    """
    if isinstance(step, Sequential):
        return step.steps
    if isinstance(step, Parallel):
        return step.branches
    if isinstance(step, Loop | DynamicLoop):
        return (step.body,)
    return ()


def iter_leaves(step: Step):
    """Yield every NodeCall and Assign inside a step, depth first, in program order."""
    if isinstance(step, NodeCall | Assign):
        yield step
    for child in children(step):
        yield from iter_leaves(child)


def iter_walk_leaves(walk: Walk):
    """Every NodeCall and Assign of a walk: its body's, then its streaming consumer fragments'."""
    for step in walk_steps(walk):
        yield from iter_leaves(step)


def iter_loops(step: Step):
    """Yield every Loop and DynamicLoop inside a step, depth first (a walk's loops are numbered so)."""
    if isinstance(step, Loop | DynamicLoop):
        yield step
    for child in children(step):
        yield from iter_loops(child)
