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
    """Invoke one node. `inputs` maps node input -> env name; `outputs` maps node output -> env name."""

    node: str
    inputs: Mapping[str, str] = attrs.field(factory=dict, converter=_frozen_mapping)
    outputs: Mapping[str, str] = attrs.field(factory=dict, converter=_frozen_mapping)
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping)

    def env_input(self, name: str) -> str:
        return self.inputs.get(name, name)

    def env_output(self, name: str) -> str:
        return self.outputs.get(name, name)


def _accumulate_map(value: Any) -> Mapping[str, str]:
    """`accumulate` is names (each list stored under the same name) or a map name -> list name."""
    if isinstance(value, Mapping):
        return _frozen_mapping(value)
    return _frozen_mapping({name: name for name in _str_tuple(value)})


def _as_step(step: Any) -> Step:
    if isinstance(step, str):
        return NodeCall(step)
    if isinstance(step, NodeCall | Sequential | Parallel | Loop | DynamicLoop):
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
    """Fan out: branches run concurrently on the same inputs; their outputs are joined by name."""

    branches: tuple[Step, ...]

    def __init__(self, *branches: Any):
        self.__attrs_init__(_as_steps(branches))


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


Step = Union[NodeCall, Sequential, Parallel, Loop, DynamicLoop]  # noqa: UP007 (forward refs)


@attrs.frozen
class StreamingGraphEdge:
    """Feed `src` ('node.output', produced repeatedly inside the walk) into `dst` ('node.input').

    The consumer fires whenever `policy` forms a chunk, while the producer is still running. The
    consumer receives a `Chunk` on `dst`'s input; its other inputs are read from the env. Values
    for which `keep(value)` is false are not part of the stream (e.g. non-audio tokens).
    """

    src: str
    dst: str
    policy: ChunkPolicy | None
    keep: Callable[[Any], bool] | None = attrs.field(default=None, eq=False)
    outputs: Mapping[str, str] = attrs.field(factory=dict, converter=_frozen_mapping)

    @property
    def src_node(self) -> str:
        return parse_port(self.src, "StreamingGraphEdge.src")[0]

    @property
    def src_output(self) -> str:
        return parse_port(self.src, "StreamingGraphEdge.src")[1]

    @property
    def dst_node(self) -> str:
        return parse_port(self.dst, "StreamingGraphEdge.dst")[0]

    @property
    def dst_input(self) -> str:
        return parse_port(self.dst, "StreamingGraphEdge.dst")[1]


@attrs.frozen(kw_only=True)
class Walk:
    """A named phase of a model's behaviour.

    `inputs` are the env names the walk needs on entry; `optional_inputs` names the request (or an
    earlier walk of the plan) may supply or leave out, which is what a node's optional input may
    read when no step of the walk produces it. `outputs` are the names it guarantees on exit.
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


def iter_calls(step: Step):
    """Yield every NodeCall inside a step, depth first, in program order."""
    if isinstance(step, NodeCall):
        yield step
    elif isinstance(step, Sequential):
        for s in step.steps:
            yield from iter_calls(s)
    elif isinstance(step, Parallel):
        for s in step.branches:
            yield from iter_calls(s)
    else:
        yield from iter_calls(step.body)


def iter_loops(step: Step):
    """Yield every Loop and DynamicLoop inside a step, depth first (a walk's loops are numbered so)."""
    if isinstance(step, Loop | DynamicLoop):
        yield step
        yield from iter_loops(step.body)
    elif isinstance(step, Sequential):
        for s in step.steps:
            yield from iter_loops(s)
    elif isinstance(step, Parallel):
        for s in step.branches:
            yield from iter_loops(s)
