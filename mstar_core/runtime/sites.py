"""A walk compiled for the conductor: one site per step, keyed by its position in the walk.

Graph objects are immutable specs and may be shared: one `NodeCall` or loop object can appear in
two walks (placed on different workers there) or twice in one walk. Everything the runtime
decides per use (merged call options, the scheduler, whether a loop is delegated, which streams a
loop reads) is stored on the site, so it follows the position, not the object's identity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import MappingProxyType
from typing import Any

from mstar_core.graph.graph import Graph
from mstar_core.graph.walk import (
    Assign,
    DynamicLoop,
    FromEnv,
    Loop,
    NodeCall,
    Parallel,
    Sequential,
    Step,
    Walk,
    children,
    iter_calls,
)

Path = tuple[int, ...]


class CallSite:
    """One NodeCall at one position: its env wiring, its merged options, the scheduler it goes to."""

    __slots__ = ("call", "dynamic", "inputs", "node", "optional_inputs", "options", "outputs", "path", "prioritised",
                 "scheduler")

    def __init__(self, graph: Graph, walk: Walk, call: NodeCall, path: Path, scheduler: Any):
        node = graph.nodes[call.node]
        self.call = call
        self.node = call.node
        self.path = path
        self.inputs = tuple((port, call.env_input(port)) for port in node.inputs)
        # only those in the walk's scope at this position: never a name an earlier walk left in the env
        self.optional_inputs = tuple((port, call.env_input(port)) for port in graph.optional_ports(walk.name, path, call))
        self.outputs = tuple((port, call.env_output(port)) for port in node.outputs)  # (node output, env name)
        static = {k: v for k, v in call.options.items() if not isinstance(v, FromEnv)}
        # static node options overlaid with the call site's (graphs are immutable: once per site)
        self.options = MappingProxyType({**node.options, **static}) if call.options else node.options
        self.dynamic = tuple((k, v) for k, v in call.options.items() if isinstance(v, FromEnv))
        self.scheduler = scheduler
        self.prioritised = any(e.ranks(call.node) for e in walk.streams)


class AssignSite:
    """An `Assign` at one position: env values copied (or moved) to other names, no node involved."""

    __slots__ = ("path", "spec")

    def __init__(self, spec: Assign, path: Path):
        self.spec = spec
        self.path = path


class SequenceSite:
    __slots__ = ("path", "steps")

    def __init__(self, steps: tuple[Any, ...], path: Path):
        self.steps = steps
        self.path = path


class ParallelSite:
    __slots__ = ("branches", "path", "spec")

    def __init__(self, spec: Parallel, branches: tuple[Any, ...], path: Path):
        self.spec = spec
        self.branches = branches
        self.path = path


class LoopSite:
    """A loop at one position. `index` numbers the walk's loops depth first, the body's first, then each
    consumer fragment's; `reads` names the streams its body takes chunks from (its exit waits for them to drain)."""

    __slots__ = ("body", "index", "path", "reads", "spec", "walk")

    def __init__(self, spec: Loop | DynamicLoop, body: Any, walk: str, index: int, reads: frozenset[str],
                 path: Path):
        self.spec = spec
        self.body = body
        self.walk = walk
        self.index = index
        self.reads = reads
        self.path = path


Site = CallSite | AssignSite | SequenceSite | ParallelSite | LoopSite


class WalkSites:
    """A compiled walk: the body, each streaming edge's consumer, and which stage closes which stream.

    `consumers[k]` is edge k's consumer fragment, `stream_calls[k]` its per-chunk consumer call;
    `closes[stage]` lists the streams whose producer runs in that stage (None: the body; k: edge k's
    consumer), closed when the stage ends. `loops[i]` is the walk's i-th loop, depth first, the body's
    before the consumer fragments' (the numbering delegated loops use on the wire).
    """

    def __init__(self, walk: Walk):
        self.walk = walk
        # names the walk's calls take as optional inputs but does not declare: only this walk's own steps
        # write them, so a value under one at the walk's start (an earlier walk's) is hidden while it runs
        self.scoped: frozenset[str] = frozenset()
        self.body: Site | None = None
        self.consumers: dict[int, Site] = {}
        self.stream_calls: dict[int, CallSite] = {}
        self.closes: dict[int | None, list[int]] = {}
        self.loops: list[LoopSite] = []


def compile_walk(graph: Graph, walk: Walk, scheduler: Callable[[str, str], Any]) -> WalkSites:
    """Build the sites of `walk`; `scheduler(walk, node)` names where each call goes."""
    sites = WalkSites(walk)
    stream_names = frozenset(e.into for e in walk.streams if e.consumer is not None)

    def build(step: Step, path: Path) -> Site:
        if isinstance(step, NodeCall):
            return CallSite(graph, walk, step, path, scheduler(walk.name, step.node))
        if isinstance(step, Assign):
            return AssignSite(step, path)
        if isinstance(step, Sequential | Parallel):
            kids = tuple(build(s, (*path, i)) for i, s in enumerate(children(step)))
            return SequenceSite(kids, path) if isinstance(step, Sequential) else ParallelSite(step, kids, path)
        index = len(sites.loops)
        sites.loops.append(None)  # numbered before its inner loops, as `iter_loops` does
        reads = frozenset(name for c in iter_calls(step.body) for name in _reads(graph, c) if name in stream_names)
        site = LoopSite(step, build(step.body, (*path, 0)), walk.name, index, reads, path)
        sites.loops[index] = site
        return site

    sites.body = build(walk.body, (0,))
    producers: dict[str, int | None] = {}
    for call in iter_calls(walk.body):
        producers.setdefault(call.node, None)
    for k, edge in enumerate(walk.streams):
        if edge.consumer is not None:
            sites.consumers[k] = build(edge.consumer, (k + 1,))
            for call in iter_calls(edge.consumer):
                producers.setdefault(call.node, k)
        else:
            sites.stream_calls[k] = CallSite(graph, walk, NodeCall(edge.dst_node, outputs=edge.outputs), (k + 1,),
                                             scheduler(walk.name, edge.dst_node))
            producers.setdefault(edge.dst_node, k)
    declared = {*walk.inputs, *walk.optional_inputs}
    calls = [*(c for b in (sites.body, *sites.consumers.values()) for c in iter_call_sites(b)), *sites.stream_calls.values()]
    sites.scoped = frozenset(name for c in calls for _, name in c.optional_inputs if name not in declared)
    sites.closes = {None: [], **{k: [] for k in range(len(walk.streams))}}
    for k, edge in enumerate(walk.streams):
        sites.closes[producers.get(edge.src_node)].append(k)
    return sites


def site_children(site: Site) -> tuple[Site, ...]:
    """The sites directly inside `site`, as `walk.children` gives a step's (none for a call or an assign)."""
    if isinstance(site, SequenceSite):
        return site.steps
    if isinstance(site, ParallelSite):
        return site.branches
    if isinstance(site, LoopSite):
        return (site.body,)
    return ()


def iter_call_sites(site: Site) -> Iterator[CallSite]:
    """Every call site under `site`, depth first in program order (the order of `iter_calls`)."""
    if isinstance(site, CallSite):
        yield site
    for child in site_children(site):
        yield from iter_call_sites(child)


def _reads(graph: Graph, call: NodeCall) -> set[str]:
    return {n for p in graph.nodes[call.node].all_inputs if (n := call.env_input(p)) is not None}
