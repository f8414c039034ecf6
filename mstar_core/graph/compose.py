"""A loaded model's nodes and walks as one part of a larger graph: every name given the part's prefix.

A composed model (an ASR, a chat model and a TTS as one voice agent) is built from the graphs of models already
loaded. Each part keeps its nodes (the same objects' modules, the same engines) under `<part>/<node>` and its env
names under `<part>:<name>`, so two parts that both write `next_token` or read `sampling` never meet. Walks,
loops, streams and call options are renamed here; a loop's `until` or `max_iters` callable (which reads the env by
the part's own names) sees the env through `PartEnv`, a view that adds the prefix back. Nothing here knows any
model: the renaming is structural.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs

from mstar_core.graph.graph import Graph
from mstar_core.graph.node import GraphNode
from mstar_core.graph.options import node_ref_options
from mstar_core.graph.walk import (
    Assign,
    DynamicLoop,
    FromEnv,
    Loop,
    NodeCall,
    Parallel,
    Sequential,
    Step,
    StreamingGraphEdge,
    Walk,
    children,
)

#: between a part's name and one of its nodes (`asr/decoder`): not '.', which separates a node from its port
NODE_SEP = "/"
#: between a part's name and one of its env names (`asr:next_token`)
ENV_SEP = ":"


class PartEnv(Mapping[str, Any]):
    """The request's env as one part sees it: its own names, without the prefix (what its loops' callables read)."""

    __slots__ = ("_env", "_prefix")

    def __init__(self, env: Mapping[str, Any], part: str):
        self._env, self._prefix = env, part + ENV_SEP

    def __getitem__(self, name: str) -> Any:
        return self._env[self._prefix + name]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._prefix + name in self._env

    def __iter__(self) -> Iterator[str]:
        n = len(self._prefix)
        return (k[n:] for k in self._env if k.startswith(self._prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


@attrs.frozen
class PartNames:
    """How one part's names read inside the composed graph."""

    part: str
    graph: Graph

    def node(self, name: str) -> str:
        return f"{self.part}{NODE_SEP}{name}"

    def env(self, name: str) -> str:
        return f"{self.part}{ENV_SEP}{name}"

    def walk(self, name: str) -> str:
        return f"{self.part}.{name}"

    def port(self, port: str) -> str:
        """`node.port` -> `<part>/node.port`."""
        node, _, name = port.partition(".")
        return f"{self.node(node)}.{name}"

    # -- nodes --------------------------------------------------------------------------------------------

    def nodes(self) -> list[GraphNode]:
        """The part's nodes under their composed names: the same module factories (the same loaded weights)."""
        out = []
        for node in self.graph.nodes.values():
            options = dict(node.options)
            for key in node_ref_options(node.engine):  # an option naming another node of the part (a peer)
                if isinstance(options.get(key), str):
                    options[key] = self.node(options[key])
            out.append(attrs.evolve(node, name=self.node(node.name), options=options, graph=None, call_sites=()))
        return out

    # -- steps --------------------------------------------------------------------------------------------

    def step(self, step: Step, walk: str | None = None, path: tuple[int, ...] = (0,)) -> Step:
        """`step` with every node and env name given the part's prefix.

        `walk` and `path`: where `step` sits in one of the part's walks. Each call then keeps exactly the optional
        inputs it took there (`Graph.optional_ports`) and maps the others to None, since in the composed graph every
        port is mapped by name and an unmapped optional input would otherwise read a name no walk declares.
        """
        if isinstance(step, NodeCall):
            node = self.graph.nodes[step.node]
            taken = node.optional_inputs if walk is None else self.graph.optional_ports(walk, path, step)
            inputs = {p: self.env(step.env_input(p)) for p in node.inputs}
            inputs.update({p: self.env(step.env_input(p)) if p in taken else None for p in node.optional_inputs})
            outputs = {p: self.env(step.env_output(p)) for p in node.outputs}
            options = {k: self._option(v) for k, v in step.options.items()}
            return NodeCall(self.node(step.node), inputs=inputs, outputs=outputs, options=options)
        if isinstance(step, Assign):
            return Assign({self.env(d): self.env(s) for d, s in step.names.items()}, move=step.move,
                          replace=step.replace)
        inner = [self.step(s, walk, (*path, i)) for i, s in enumerate(children(step))]
        if isinstance(step, Sequential):
            return Sequential(*inner)
        if isinstance(step, Parallel):
            count = self.env(step.count) if isinstance(step.count, str) else step.count
            collect = None if step.collect is None else {self.env(k): self.env(v) for k, v in step.collect.items()}
            return Parallel(*inner, count=count, index_name=self.env(step.index_name), collect=collect)
        if isinstance(step, Loop):
            iters = self.env(step.iters) if isinstance(step.iters, str) else step.iters
            return Loop(body=inner[0], iters=iters, carry=self._names(step.carry),
                        accumulate=self._names(step.accumulate), index_name=self.env(step.index_name))
        if isinstance(step, DynamicLoop):
            limit = step.max_iters
            limit = self.env(limit) if isinstance(limit, str) else self.read(limit) if callable(limit) else limit
            return DynamicLoop(body=inner[0], until=None if step.until is None else self.read(step.until),
                               max_iters=limit, carry=self._names(step.carry),
                               accumulate=self._names(step.accumulate), index_name=self.env(step.index_name))
        raise TypeError(f"cannot rename a {type(step).__name__} step")

    def read(self, fn: Callable[[Mapping[str, Any]], Any]) -> Callable[[Mapping[str, Any]], Any]:
        """A callable of the part's env, made a callable of the composed env."""
        part = self.part
        return lambda env: fn(PartEnv(env, part))

    def _names(self, mapping: Mapping[str, str]) -> dict[str, str]:
        return {self.env(k): self.env(v) for k, v in mapping.items()}

    def _option(self, value: Any) -> Any:
        if isinstance(value, FromEnv):
            return FromEnv(self.env(value.name), value.derive)
        return value

    def stream(self, edge: StreamingGraphEdge, walk: str | None = None, index: int = 0) -> StreamingGraphEdge:
        """A streaming edge of the part's walk `walk` (its `index`-th). A per-chunk consumer (`dst=`) is called with the
        chunk alone: its other inputs are matched by port name, which a prefixed env never has."""
        consumer = None if edge.consumer is None else self.step(edge.consumer, walk, (index + 1,))
        # a per-chunk consumer's outputs (lists in the env) take the part's prefix too
        dst_outputs = () if edge.dst_node is None else self.graph.nodes[edge.dst_node].outputs
        outputs = {p: self.env(edge.outputs.get(p, p)) for p in dst_outputs}
        return StreamingGraphEdge(
            self.port(edge.src), None if edge.dst is None else self.port(edge.dst), edge.policy, keep=edge.keep,
            outputs=outputs, into=None if edge.into is None else
            self.env(edge.into), consumer=consumer,
            priority=edge.priority, segment_by=None if edge.segment_by is None else self.env(edge.segment_by))

    def walk_spec(self, walk: Walk, name: str | None = None) -> Walk:
        """One of the part's walks, renamed whole (its name becomes `<part>.<walk>` unless `name` is given)."""
        return Walk(name=name or self.walk(walk.name), body=self.step(walk.body, walk.name),
                    inputs=[self.env(n) for n in walk.inputs],
                    optional_inputs=[self.env(n) for n in walk.optional_inputs],
                    outputs=[self.env(n) for n in walk.outputs], emit=[self.env(n) for n in walk.emit],
                    streams=[self.stream(e, walk.name, k) for k, e in enumerate(walk.streams)], description=walk.description)

    def prefixed(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """A part's env (what its `prepare` returned) under the composed names."""
        return {self.env(k): v for k, v in values.items()}


def map_calls(step: Step, fn: Callable[[NodeCall], NodeCall]) -> Step:
    """`step` rebuilt with `fn` applied to each NodeCall, in program order (the rest unchanged)."""
    if isinstance(step, NodeCall):
        return fn(step)
    if isinstance(step, Assign):
        return step
    inner = [map_calls(s, fn) for s in children(step)]
    if isinstance(step, Sequential):
        return Sequential(*inner)
    if isinstance(step, Parallel):
        return Parallel(*inner, count=step.count, index_name=step.index_name, collect=step.collect)
    return attrs.evolve(step, body=inner[0])
