"""Graph: the computation graph G (nodes) plus its named walks W, validated when built."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from mstar_core.errors import GraphValidationError
from mstar_core.graph.node import GraphEdge, GraphNode
from mstar_core.graph.options import check_call_options, known_call_options, node_ref_options
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
    iter_calls,
    iter_leaves,
    iter_loops,
    iter_walk_calls,
    walk_steps,
)

Plan = Callable[[Mapping[str, Any]], Sequence[str]]
#: A step's position in its walk: (0, ...) the body, (k + 1, ...) streaming edge k's consumer; each
#: child of a Sequential or Parallel at (*parent, i), a loop's body at (*parent, 0).
Path = tuple[int, ...]


@attrs.frozen
class Branch:
    """A plan that branches on outputs: after walk `after`, run the walks `choose(env)` names next.

    `choose` sees the request's env at the walk boundary and returns a walk name, a list of names
    (run in order, before the rest of the plan), or None / [] for none. Every name it may return is
    declared in `walks` and checked at `Graph.build`; returning another is a request error naming
    the declared ones. Branches may not form a cycle (a request's walks stay finite).

        Branch(after="decode", choose=lambda env: "image_gen" if env["wants_image"] else None,
               walks=("image_gen",))
    """

    after: str
    choose: Callable[[Mapping[str, Any]], str | Sequence[str] | None] = attrs.field(eq=False)
    walks: tuple[str, ...] = attrs.field(converter=lambda v: (v,) if isinstance(v, str) else tuple(v))

    def next_walks(self, env: Mapping[str, Any]) -> list[str]:
        """The walks chosen for this env, checked against the declared ones."""
        chosen = self.choose(env)
        names = [] if chosen is None else [chosen] if isinstance(chosen, str) else list(chosen)
        for name in names:
            if name not in self.walks:
                raise KeyError(f"the plan's branch after walk '{self.after}' chose walk {name!r}, which it does not "
                               f"declare; it may choose {list(self.walks)}")
        return names


@attrs.frozen
class Graph:
    """An immutable model spec: nodes, walks, and the plan mapping a request to its walks.

    Build it with `Graph.build(...)`, which validates every walk. `plan(inputs)` returns the walk
    names a request takes, in order; the default runs the only walk, or the one named by the
    request's `walk` input.
    """

    name: str
    nodes: Mapping[str, GraphNode]
    walks: Mapping[str, Walk]
    plan_fn: Plan | None = attrs.field(default=None, eq=False)
    branches: Mapping[str, Branch] = attrs.field(factory=dict, eq=False)
    #: walk -> call position -> the optional inputs that call takes (its walk's scope; see `optional_ports`)
    bindings: Mapping[str, Mapping[Path, tuple[str, ...]]] = attrs.field(factory=dict, eq=False)

    @classmethod
    def build(
        cls,
        name: str,
        nodes: Iterable[GraphNode],
        walks: Iterable[Walk],
        plan: Plan | None = None,
        branches: Iterable[Branch] = (),
    ) -> Graph:
        node_map: dict[str, GraphNode] = {}
        for node in nodes:
            if node.name in node_map:
                raise GraphValidationError(f"duplicate node name '{node.name}'", node=node.name)
            if len(set(node.all_inputs)) != len(node.all_inputs):
                raise GraphValidationError("duplicate input name", node=node.name)
            if len(set(node.outputs)) != len(node.outputs):
                raise GraphValidationError("duplicate output name", node=node.name)
            node_map[node.name] = node
        walk_map: dict[str, Walk] = {}
        for walk in walks:
            if walk.name in walk_map:
                raise GraphValidationError(f"duplicate walk name '{walk.name}'", walk=walk.name)
            walk_map[walk.name] = walk
        if not walk_map:
            raise GraphValidationError(f"model '{name}' declares no walks")
        from types import MappingProxyType

        branch_map = _check_branches(walk_map, branches)
        graph = cls(name, MappingProxyType(node_map), MappingProxyType(walk_map), plan, MappingProxyType(branch_map))
        bindings = {walk.name: MappingProxyType(_WalkChecker(graph, walk).check()) for walk in walk_map.values()}
        sites: dict[str, list[tuple[str, Mapping[str, Any]]]] = {n: [] for n in node_map}
        for walk in walk_map.values():
            for call in iter_walk_calls(walk):
                sites[call.node].append((walk.name, call.options))
        for node in node_map.values():
            known = known_call_options(node.engine)
            if known is not None:
                check_call_options(node.name, node.engine, sites[node.name], known, node.options)
            for option in node_ref_options(node.engine):
                ref = node.options.get(option)
                if ref is not None and (ref not in node_map or node_map[ref].engine != node.engine or ref == node.name):
                    raise GraphValidationError(
                        f"option {option}={ref!r} must name another '{node.engine}' node of the graph; "
                        f"'{node.engine}' nodes: {sorted(n for n, d in node_map.items() if d.engine == node.engine)}",
                        node=node.name,
                    )
        # each node learns its model and call sites (the engine checks options again at load from them)
        nodes = {n: attrs.evolve(node, graph=name, call_sites=tuple(sites[n])) for n, node in node_map.items()}
        return cls(name, MappingProxyType(nodes), MappingProxyType(walk_map), plan, MappingProxyType(branch_map),
                   MappingProxyType(bindings))

    def optional_ports(self, walk: str, path: Path, call: NodeCall) -> tuple[str, ...]:
        """The optional inputs of the call at `path` in `walk` that it takes, when the env has them.

        Those whose env name the walk declares or an earlier step (or, in a loop, any step of its
        body) produces; not those the call maps to None or the walk never has. A graph made without
        `build` has no bindings: every optional input is taken.
        """
        taken = self.bindings.get(walk, {}).get(path)
        if taken is not None:
            return taken
        return tuple(p for p in self.nodes[call.node].optional_inputs if call.env_input(p) is not None)

    def plan(self, inputs: Mapping[str, Any]) -> list[str]:
        """The walk names a request with these inputs starts with, checked against the graph.

        Walks a `Branch` chooses from outputs come on top of these, at run time (`next_walks`).
        """
        if self.plan_fn is not None:
            names = list(self.plan_fn(inputs))
        elif "walk" in inputs:
            names = [inputs["walk"]]
        elif len(self.walks) == 1:
            names = list(self.walks)
        else:
            raise KeyError(f"model '{self.name}' has several walks ({', '.join(self.walks)}) and no plan; pass a 'walk' input")
        for n in names:
            if not isinstance(n, str) or n not in self.walks:
                raise KeyError(f"plan chose unknown walk '{n}'; walks: {', '.join(self.walks)}")
        return names

    def declared_outputs(self, walks: Iterable[str]) -> list[str]:
        """The declared `outputs` of these walks (those a request ran), each name once, in walk order."""
        return list(dict.fromkeys(name for walk in walks for name in self.walks[walk].outputs))

    def next_walks(self, walk: str, env: Mapping[str, Any]) -> list[str]:
        """The walks a branch of the plan adds after `walk` for this env (none without a branch)."""
        branch = self.branches.get(walk)
        return [] if branch is None else branch.next_walks(env)

    def edges(self, walk: str) -> list[GraphEdge]:
        """Data edges of a walk: each node input linked to the latest call that produced it."""
        return _derive_edges(self, self.walks[walk])


def _check_branches(walks: Mapping[str, Walk], branches: Iterable[Branch]) -> dict[str, Branch]:
    out: dict[str, Branch] = {}
    known = ", ".join(walks)
    for branch in branches:
        if not isinstance(branch, Branch):
            raise GraphValidationError(f"plan branches must be Branch(...), got {type(branch).__name__}")
        if branch.after not in walks:
            raise GraphValidationError(f"plan branch after unknown walk '{branch.after}'; walks: {known}")
        if branch.after in out:
            raise GraphValidationError(f"two plan branches after walk '{branch.after}'; merge them", walk=branch.after)
        for name in branch.walks:
            if name not in walks:
                raise GraphValidationError(
                    f"the plan's branch after '{branch.after}' may choose unknown walk '{name}'; walks: {known}",
                    walk=branch.after,
                )
        out[branch.after] = branch
    # a cycle would let a request take walks forever
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 1:
            cycle = " -> ".join([*path[path.index(name):], name])
            raise GraphValidationError(f"the plan's branches form a cycle: {cycle}", walk=name)
        if state.get(name) == 2:
            return
        state[name] = 1
        for nxt in out[name].walks if name in out else ():
            visit(nxt, [*path, name])
        state[name] = 2

    for name in out:
        visit(name, [])
    return out


# ---------------------------------------------------------------------------------------------


class _WalkChecker:
    """Static checks of one walk; every error names the walk and the node."""

    def __init__(self, graph: Graph, walk: Walk):
        self.graph = graph
        self.walk = walk
        self.calls = list(iter_walk_calls(walk))
        # env names of streams that consumer fragments take chunks from (valid only inside their fragment)
        self.stream_names: set[str] = set()
        # names a loop body produces: an optional input may read them on later iterations
        self.loop_outputs: set[str] = set()
        # call position -> the optional inputs that call takes (what `check` returns)
        self.bound: dict[Path, tuple[str, ...]] = {}

    def fail(self, message: str, node: str | None = None) -> None:
        raise GraphValidationError(message, walk=self.walk.name, node=node)

    def check(self) -> dict[Path, tuple[str, ...]]:
        """Check the walk; return each call position's taken optional inputs."""
        for call in self.calls:
            self.check_call_ports(call)
        entry = {*self.walk.inputs, *self.walk.optional_inputs}
        produced = self.step(self.walk.body, entry, loop_depth=0, path=(0,))
        for k, edge in enumerate(self.walk.streams):
            produced |= self.check_stream(edge, produced, entry, (k + 1,))
        for name in self.walk.emit:
            if name not in produced:
                self.fail(f"emit names '{name}', which no step or stream of the walk produces")
        for name in self.walk.outputs:
            if name not in produced:
                self.fail(f"output '{name}' is never produced; produced: {sorted(produced)}")
        return self.bound

    def node(self, name: str) -> GraphNode:
        try:
            return self.graph.nodes[name]
        except KeyError:
            known = ", ".join(sorted(self.graph.nodes)) or "(none)"
            self.fail(f"unknown node '{name}'; known nodes: {known}", node=name)
            raise  # unreachable, for type checkers

    def check_call_ports(self, call: NodeCall) -> None:
        node = self.node(call.node)
        for port in call.inputs:
            if port not in node.all_inputs:
                self.fail(f"renames input '{port}', but the node's inputs are {list(node.all_inputs)}", call.node)
            if call.inputs[port] is None and port not in node.optional_inputs:
                self.fail(f"maps required input '{port}' to None; only an optional input may be left out", call.node)
        for port in call.outputs:
            if port not in node.outputs:
                self.fail(f"renames output '{port}', but the node's outputs are {list(node.outputs)}", call.node)

    def step(self, step: Step, avail: set[str], loop_depth: int, path: Path) -> set[str]:
        """Return the names available after `step`, given those available before it."""
        if isinstance(step, NodeCall):
            node = self.graph.nodes[step.node]
            for port in node.inputs:
                name = step.env_input(port)
                if name not in avail and not (loop_depth and name == "loop_index"):
                    self.missing_input(step, port, name)
            self.bound[path] = self.optional_taken(step, node.optional_inputs, avail)
            for key, value in step.options.items():
                if isinstance(value, FromEnv) and value.name not in avail:
                    self.fail(f"call option '{key}' reads env name '{value.name}', which is not available where the "
                              f"call runs; available: {sorted(avail)}", step.node)
            return avail | {step.env_output(o) for o in node.outputs}
        if isinstance(step, Assign):
            return self.assign(step, avail, loop_depth)
        if isinstance(step, Sequential):
            for i, s in enumerate(children(step)):
                avail = self.step(s, avail, loop_depth, (*path, i))
            return avail
        if isinstance(step, Parallel) and step.fan_out:
            return self.fan_out(step, avail, loop_depth, path)
        if isinstance(step, Parallel):
            if not step.branches:
                self.fail("Parallel() has no branches")
            joined = set(avail)
            owner: dict[str, int] = {}
            for i, branch in enumerate(children(step)):
                out = self.step(branch, set(avail), loop_depth, (*path, i)) - avail
                for name in out:
                    if name in owner:
                        self.fail(
                            f"duplicate name '{name}': Parallel branches {owner[name]} and {i} both "
                            "write it; rename one branch's output"
                        )
                    owner[name] = i
                joined |= out
            return joined
        if isinstance(step, Loop | DynamicLoop):
            return self.loop(step, avail, loop_depth, path)
        raise TypeError(step)

    def optional_taken(self, call: NodeCall, ports: Sequence[str], avail: set[str]) -> tuple[str, ...]:
        """The optional inputs `call` takes: those whose env name is in the walk's scope where it runs.

        Left out: a port mapped to None, and an unmapped one whose name the walk never has (another
        walk may supply it; this one does not). A port mapped to a name the walk never has is a typo.
        """
        taken = []
        for port in ports:
            name = call.env_input(port)
            if name is None:
                continue
            if name in avail or name in self.loop_outputs:
                taken.append(port)
            else:
                self.missing_optional_input(call, port, name, mapped=port in call.inputs)
        return tuple(taken)

    def assign(self, step: Assign, avail: set[str], loop_depth: int) -> set[str]:
        where = step.label
        for dst, src in step.names.items():
            if src not in avail and not (loop_depth and src == "loop_index"):
                self.fail(f"{where} reads '{src}', which is not available where it runs; available: {sorted(avail)}")
            if dst in avail and not step.replace and not (step.move and dst in step.names.values()):
                self.fail(f"{where} would overwrite '{dst}', which is already available there; pick another name, "
                          "or pass replace=True if replacing it is the point")
        out = set(avail) | set(step.names)
        if step.move:
            out -= set(step.names.values()) - set(step.names)
        return out

    def fan_out(self, step: Parallel, avail: set[str], loop_depth: int, path: Path) -> set[str]:
        first_call = next(iter_calls(step.branches[0]), None)
        where = first_call.node if first_call else None
        if isinstance(step.count, int) and step.count < 0:
            self.fail(f"Parallel count must be >= 0, got {step.count}", where)
        if isinstance(step.count, str) and step.count not in avail:
            self.fail(f"Parallel count names '{step.count}', which is not available before the fan-out", where)
        if not isinstance(step.count, int | str):
            self.fail(f"Parallel count must be an int or an env name, got {step.count!r}", where)
        out = self.step(step.branches[0], avail | {step.index_name}, loop_depth, (*path, 0)) - avail - {step.index_name}
        if step.collect is None:
            return avail | out
        for name in step.collect:
            if name not in out:
                self.fail(f"Parallel collect names '{name}', which the fanned-out body does not write; "
                          f"it writes {sorted(out)}", where)
        return avail | set(step.collect.values())

    def loop(self, loop: Loop | DynamicLoop, avail: set[str], loop_depth: int, path: Path) -> set[str]:
        first_call = next(iter_calls(loop.body), None)
        where = first_call.node if first_call else None
        if isinstance(loop, Loop):
            if isinstance(loop.iters, int) and loop.iters < 0:
                self.fail(f"Loop iters must be >= 0, got {loop.iters}", where)
            if isinstance(loop.iters, str) and loop.iters not in avail:
                self.fail(f"Loop iters names '{loop.iters}', which is not available before the loop", where)
        else:
            if loop.until is None:
                self.fail("loop without exit: DynamicLoop needs an `until` condition", where)
            if loop.max_iters is None:
                self.fail("loop without exit: DynamicLoop needs a `max_iters` ceiling", where)
            if isinstance(loop.max_iters, str) and loop.max_iters not in avail:
                self.fail(f"DynamicLoop max_iters names '{loop.max_iters}', which is not available", where)
        inner = set(avail) | {loop.index_name}
        outer_loop_outputs = self.loop_outputs
        self.loop_outputs = outer_loop_outputs | {n for c in iter_leaves(loop.body) for n in _leaf_outputs(self.graph, c)}
        after = self.step(loop.body, inner, loop_depth + 1, (*path, 0))
        self.loop_outputs = outer_loop_outputs
        for out, into in loop.carry.items():
            if out not in after:
                self.fail(f"carry source '{out}' is not produced by the loop body", where)
            if into not in avail:
                self.fail(
                    f"carry target '{into}' has no value for the first iteration; produce it before the loop",
                    where,
                )
        for name in loop.accumulate:
            if name not in after:
                self.fail(f"accumulate names '{name}', which the loop body does not produce", where)
        return (after - {loop.index_name}) | avail | set(loop.accumulate.values())

    def missing_input(self, call: NodeCall, port: str, name: str) -> None:
        index = next(i for i, c in enumerate(self.calls) if c is call)
        later = [c for c in self.calls[index + 1 :] if name in _call_outputs(self.graph, c)]
        if later:
            producer = later[0]
            reach = set(_call_outputs(self.graph, call))
            for c in self.calls[index + 1 :]:
                if _call_inputs(self.graph, c) & reach:
                    if c is producer:
                        self.fail(
                            f"cycle outside a loop: input '{port}' (env '{name}') comes from node "
                            f"'{producer.node}', which depends on this node's output; wrap the cycle in "
                            "a Loop or DynamicLoop with `carry`",
                            call.node,
                        )
                    reach |= _call_outputs(self.graph, c)
            self.fail(
                f"input '{port}' (env '{name}') is produced only later, by node '{producer.node}'; reorder the steps",
                call.node,
            )
        self.fail(
            f"unconnected input '{port}' (env '{name}'): not a walk input and no earlier step produces it",
            call.node,
        )

    def missing_optional_input(self, call: NodeCall, port: str, name: str, mapped: bool) -> None:
        """An optional input outside the walk's scope: left out, unless mapped (a typo) or produced too late."""
        index = next(i for i, c in enumerate(self.calls) if c is call)
        later = [c for c in self.calls[index + 1 :] if name in _call_outputs(self.graph, c)]
        if later:
            self.fail(
                f"optional input '{port}' (env '{name}') is produced only later, by node '{later[0].node}', "
                "so this call would never read it; reorder the steps",
                call.node,
            )
        if mapped:  # the call names a source the walk can never have: it would be dropped silently at run time
            self.fail(
                f"optional input '{port}' is mapped to env '{name}', which this walk can never have: no earlier "
                f"step produces it and it is not among the walk's inputs or optional_inputs; declare it with "
                f"Walk(optional_inputs=('{name}',)) if the request or an earlier walk supplies it, fix the name, "
                f"or map '{port}' to None to leave it out",
                call.node,
            )

    def check_stream(self, edge: StreamingGraphEdge, produced: set[str], entry: set[str], path: Path) -> set[str]:
        where = edge.dst_node or edge.src_node
        if edge.policy is None:
            self.fail(f"streaming edge {edge.name} has no chunk policy", where)
        if edge.segment_by is not None:
            loops = {loop.index_name for step in walk_steps(self.walk) for loop in iter_loops(step)}
            if edge.segment_by not in loops:
                self.fail(f"streaming edge {edge.name}: segment_by={edge.segment_by!r} names no loop of the walk; "
                          f"its loops' index names: {sorted(loops)}", where)
        src = self.node(edge.src_node)
        if edge.src_output not in src.outputs:
            self.fail(f"streaming edge source '{edge.src}': node outputs are {list(src.outputs)}", src.name)
        per_chunk = {e.dst_node for e in self.walk.streams if e.dst is not None}
        for name in edge.fed_by:
            if not any(c.node == name for c in self.calls):
                self.fail(f"streaming edge {edge.name}: fed_by names node '{name}', which this walk never calls", name)
        if not any(c.node == src.name for c in self.calls) and src.name not in per_chunk:
            self.fail(f"streaming edge source node '{src.name}' is not called in this walk", src.name)
        if (edge.dst is None) == (edge.consumer is None):
            self.fail(f"streaming edge {edge.name} needs exactly one consumer: dst='node.input' (one call per "
                      "chunk) or consumer=<walk fragment> with into='env name'", where)
        if edge.consumer is not None:
            return self.check_consumer(edge, entry, path)
        dst = self.node(edge.dst_node)
        if edge.dst_input not in dst.all_inputs:
            self.fail(f"streaming edge target '{edge.dst}': node inputs are {list(dst.all_inputs)}", dst.name)
        for port in dst.inputs:
            if port != edge.dst_input and port not in produced:
                self.fail(f"streaming consumer input '{port}' is not available in the walk", dst.name)
        # its other optional inputs come from the walk's scope; one the walk never has is left out
        self.bound[path] = tuple(p for p in dst.optional_inputs if p != edge.dst_input and p in produced)
        for port in edge.outputs:
            if port not in dst.outputs:
                self.fail(f"streaming edge renames output '{port}', node outputs are {list(dst.outputs)}", dst.name)
        return {edge.outputs.get(o, o) for o in dst.outputs}

    def check_consumer(self, edge: StreamingGraphEdge, entry: set[str], path: Path) -> set[str]:
        """A consumer fragment runs beside the body on the walk's inputs plus the stream it takes from."""
        calls = list(iter_calls(edge.consumer))
        where = calls[0].node if calls else edge.src_node
        if not edge.into:
            self.fail(f"streaming edge {edge.name} has a consumer fragment but no into='env name' to read chunks "
                      "from", where)
        if edge.into in self.stream_names:
            self.fail(f"two streaming edges deliver into env name '{edge.into}'; give each its own", where)
        self.stream_names.add(edge.into)
        if edge.outputs:
            self.fail(f"streaming edge {edge.name}: outputs= renames a per-chunk consumer's outputs; rename "
                      "inside the consumer fragment instead", where)
        readers = [c for c in calls if edge.into in _call_inputs(self.graph, c)]
        if not readers:
            self.fail(f"no call in the consumer fragment of {edge.name} reads '{edge.into}', so its chunks "
                      "would never be taken", where)
        return self.step(edge.consumer, entry | {edge.into}, loop_depth=0, path=path) - {edge.into}


def _leaf_outputs(graph: Graph, leaf: NodeCall | Assign) -> set[str]:
    return set(leaf.names) if isinstance(leaf, Assign) else _call_outputs(graph, leaf)


def _call_outputs(graph: Graph, call: NodeCall) -> set[str]:
    return {call.env_output(o) for o in graph.nodes[call.node].outputs}


def _call_inputs(graph: Graph, call: NodeCall) -> set[str]:
    return {n for i in graph.nodes[call.node].all_inputs if (n := call.env_input(i)) is not None}


def _derive_edges(graph: Graph, walk: Walk) -> list[GraphEdge]:
    edges: list[GraphEdge] = []
    last_writer: dict[str, tuple[str, str]] = {}
    leaves = list(iter_leaves(walk.body))
    # two passes so loop back-edges (a later call feeding an earlier one) show up too
    for pass_no in range(2):
        for call in leaves:
            if isinstance(call, Assign):  # a copied value keeps its producer
                sources = {dst: last_writer.get(src) for dst, src in call.names.items()}
                for dst, src in sources.items():
                    if src is not None:
                        last_writer[dst] = src
                continue
            node = graph.nodes[call.node]
            if pass_no == 1:
                for port in node.all_inputs:
                    src = last_writer.get(call.env_input(port))  # None (left out) was never written
                    if src is not None:
                        edge = GraphEdge(src[0], src[1], call.node, port, walk.name)
                        if edge not in edges:
                            edges.append(edge)
            for out in node.outputs:
                last_writer[call.env_output(out)] = (call.node, out)
    return edges
