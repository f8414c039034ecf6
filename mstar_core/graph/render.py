"""Render a walk as Mermaid or Graphviz DOT, so a user sees what a request does."""

from __future__ import annotations

import string

import attrs

from mstar_core.graph.graph import Graph
from mstar_core.graph.walk import (
    Assign,
    DynamicLoop,
    FromEnv,
    Loop,
    NodeCall,
    Sequential,
    Step,
    Walk,
    children,
    iter_calls,
    iter_loops,
    iter_walk_calls,
    iter_walk_leaves,
)


def _group_label(step: Step) -> str:
    if isinstance(step, Loop):
        return f"Loop x{step.iters}"
    if isinstance(step, DynamicLoop):
        until = getattr(step.until, "__name__", "until")
        limit = "f(env)" if callable(step.max_iters) else step.max_iters
        return f"DynamicLoop until {until}, max {limit}"
    if step.fan_out:
        return f"Parallel x{step.count} ({step.index_name})"
    return "Parallel"


def _option_text(value) -> str:
    """A call option as a drawing shows it: a `FromEnv` as what it computes from the env name (`$name`), not its repr.

    `FromEnv("choice")` -> `$choice`; `FromEnv("choice", "choice{}")` -> `choice{$choice}`;
    `FromEnv("i", label_of)` -> `label_of($i)`.
    """
    if not isinstance(value, FromEnv):
        return str(value)
    ref = f"${value.name}"
    if value.derive is None:
        return ref
    if callable(value.derive):
        return f"{getattr(value.derive, '__name__', 'f')}({ref})"
    parts = []
    for literal, field, spec, conversion in string.Formatter().parse(value.derive):
        parts.append(literal)
        if field is not None:  # the env value fills every replacement field, with its own format spec kept
            parts.append("{" + ref + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}")
    return "".join(parts)


def input_id(name: str) -> str:
    """A walk input's box id: Mermaid and DOT ids take word characters only (a composed model's `asr:audio`)."""
    return "in_" + "".join(ch if ch.isalnum() or ch == "_" else f"_{ord(ch):x}_" for ch in name)


def _policy_label(policy) -> str:
    if policy is None:
        return "NO POLICY"
    args = ", ".join(str(getattr(policy, f.name)) for f in attrs.fields(type(policy)))
    return f"{type(policy).__name__}({args})"


class _Layout:
    """Call ids, call-level data edges (back edges of loops flagged), and stream consumers of one walk."""

    def __init__(self, graph: Graph, walk: Walk):
        self.graph, self.walk = graph, walk
        calls = list(iter_walk_calls(walk))
        self.ids = {id(c): f"c{i}" for i, c in enumerate(calls)}
        self.edges: list[tuple[str, str, str, bool]] = []  # (src, dst, env name, back edge)
        writer = {name: input_id(name) for name in walk.inputs}
        assigns = [a for a in iter_walk_leaves(walk) if isinstance(a, Assign)]
        self.ids.update({id(a): f"a{i}" for i, a in enumerate(assigns)})
        for call in iter_walk_leaves(walk):
            if isinstance(call, Assign):  # a copy reads its sources and becomes the writer of its targets
                sources = {dst: writer.get(src) for dst, src in call.names.items()}
                for src in call.names.values():
                    self._edge(writer.get(src), self.ids[id(call)], src, False)
                for dst in sources:
                    writer[dst] = self.ids[id(call)]
                continue
            for port in graph.nodes[call.node].all_inputs:
                self._edge(writer.get(call.env_input(port)), self.ids[id(call)], call.env_input(port), False)
            for out in graph.nodes[call.node].outputs:
                writer[call.env_output(out)] = self.ids[id(call)]
        for loop in iter_loops(walk.body):
            body = list(iter_calls(loop.body))
            for i, reader in enumerate(body):  # a later call's output (or its carry) read again next iteration
                for port in graph.nodes[reader.node].all_inputs:
                    name = reader.env_input(port)
                    for later in body[i:]:
                        outs = {later.env_output(o) for o in graph.nodes[later.node].outputs}
                        if name in outs | {loop.carry.get(o, o) for o in outs}:
                            self._edge(self.ids[id(later)], self.ids[id(reader)], name, True)
        self.streams = []
        for k, edge in enumerate(walk.streams):
            src = [c for c in calls if c.node == edge.src_node]
            src_id = self.ids[id(src[-1])] if src else f"s{self._consumer_of(edge.src_node)}"
            if edge.consumer is not None:  # drawn as its own group; the stream points at the call that takes chunks
                readers = [c for c in iter_calls(edge.consumer)
                           if edge.into in {c.env_input(p) for p in graph.nodes[c.node].all_inputs}]
                dst_id = self.ids[id(readers[0])] if readers else f"s{k}"
            else:
                dst_id = f"s{k}"
            self.streams.append((src_id, dst_id, edge, _policy_label(edge.policy)))

    def _consumer_of(self, node: str) -> int:
        return next((k for k, e in enumerate(self.walk.streams) if e.dst_node == node), 0)

    def _edge(self, src: str | None, dst: str, name: str, back: bool) -> None:
        if src is not None and not any(e[:3] == (src, dst, name) for e in self.edges):
            self.edges.append((src, dst, name, back))

    def label(self, call: NodeCall) -> str:
        opts = ", ".join(f"{k}={_option_text(v)}" for k, v in call.options.items())
        return f"{call.node} [{self.graph.nodes[call.node].engine}]" + (f" {opts}" if opts else "")

    def stream_label(self, edge) -> str:
        return f"{edge.dst_node} [{self.graph.nodes[edge.dst_node].engine}] (stream)"

    @staticmethod
    def fragment_label(edge) -> str:
        return f"stream consumer, takes '{edge.into}'"


class _Writer:
    """Walks the step tree once; subclasses say how a box, a group and an edge look."""

    def __init__(self, layout: _Layout):
        self.layout = layout
        self.lines: list[str] = []
        self.depth = 1
        self.groups = 0

    def emit(self, line: str) -> None:
        self.lines.append("  " * self.depth + line)

    def tree(self, step: Step) -> None:
        if isinstance(step, NodeCall):
            self.box(self.layout.ids[id(step)], self.layout.label(step), rounded=False)
            return
        if isinstance(step, Assign):
            self.box(self.layout.ids[id(step)], step.label, rounded=True)
            return
        grouped = not isinstance(step, Sequential)
        if grouped:
            self.groups += 1
            self.open_group(f"g{self.groups}", _group_label(step))
            self.depth += 1
        for child in children(step):
            self.tree(child)
        if grouped:
            self.depth -= 1
            self.close_group()

    def render(self) -> str:
        walk = self.layout.walk
        for name in walk.inputs:
            self.box(input_id(name), name, rounded=True)
        self.tree(walk.body)
        for _src, sid, edge, _policy in self.layout.streams:
            if edge.consumer is None:
                self.box(sid, self.layout.stream_label(edge), rounded=False)
                continue
            self.groups += 1
            self.open_group(f"g{self.groups}", self.layout.fragment_label(edge))
            self.depth += 1
            self.tree(edge.consumer)
            self.depth -= 1
            self.close_group()
        self.end_walk()
        for src, dst, name, back in self.layout.edges:
            self.edge(src, dst, f"{name} (next iter)" if back else name, "back" if back else "data")
        for src, sid, edge, policy in self.layout.streams:
            self.edge(src, sid, f"{edge.src_output} ~ {policy}", "stream")
        return "\n".join(self.lines) + "\n"


class _Mermaid(_Writer):
    ARROWS = {"data": '-- "{}" -->', "back": '-. "{}" .->', "stream": '== "{}" ==>'}

    def __init__(self, layout: _Layout):
        super().__init__(layout)
        self.lines = ["flowchart TD", f'  subgraph walk_{layout.walk.name}["walk: {layout.walk.name}"]']
        self.depth = 2

    def box(self, node_id: str, label: str, rounded: bool) -> None:
        self.emit(f'{node_id}(["{label}"])' if rounded else f'{node_id}["{label}"]')

    def open_group(self, gid: str, label: str) -> None:
        self.emit(f'subgraph {gid}["{label}"]')

    def close_group(self) -> None:
        self.emit("end")

    def end_walk(self) -> None:
        self.lines.append("  end")
        self.depth = 1

    def edge(self, src: str, dst: str, label: str, kind: str) -> None:
        self.emit(f"{src} {self.ARROWS[kind].format(label)} {dst}")


class _Dot(_Writer):
    STYLES = {"data": "", "back": ", style=dashed, constraint=false", "stream": ", style=bold"}

    def __init__(self, layout: _Layout):
        super().__init__(layout)
        self.lines = [f'digraph "{layout.walk.name}" {{', "  rankdir=TB;", "  node [shape=box];"]

    def box(self, node_id: str, label: str, rounded: bool) -> None:
        self.emit(f'{node_id} [label="{label}"' + (", shape=ellipse];" if rounded else "];"))

    def open_group(self, gid: str, label: str) -> None:
        self.emit(f"subgraph cluster_{gid} {{")
        self.lines.append("  " * (self.depth + 1) + f'label="{label}";')

    def close_group(self) -> None:
        self.emit("}")

    def end_walk(self) -> None:
        pass

    def edge(self, src: str, dst: str, label: str, kind: str) -> None:
        self.emit(f'{src} -> {dst} [label="{label}"{self.STYLES[kind]}];')

    def render(self) -> str:
        return super().render() + "}\n"


def to_mermaid(graph: Graph, walk_name: str) -> str:
    """Mermaid flowchart of one walk."""
    return _Mermaid(_Layout(graph, graph.walks[walk_name])).render()


def to_dot(graph: Graph, walk_name: str) -> str:
    """Graphviz DOT digraph of one walk."""
    return _Dot(_Layout(graph, graph.walks[walk_name])).render()
