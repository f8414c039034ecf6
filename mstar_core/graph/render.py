"""Render a walk as Mermaid or Graphviz DOT, so a user sees what a request does."""

from __future__ import annotations

from collections.abc import Callable

from mstar_core.graph.graph import Graph
from mstar_core.graph.walk import DynamicLoop, Loop, NodeCall, Parallel, Sequential, Step, Walk, iter_calls


def _label_of(step: Step) -> str:
    if isinstance(step, Loop):
        return f"Loop x{step.iters}"
    if isinstance(step, DynamicLoop):
        until = getattr(step.until, "__name__", "until")
        return f"DynamicLoop until {until}, max {step.max_iters if not callable(step.max_iters) else 'f(env)'}"
    if isinstance(step, Parallel):
        return "Parallel"
    return "Sequential"


class _Layout:
    """Call ids, cluster nesting, and call-level data edges of one walk."""

    def __init__(self, graph: Graph, walk: Walk):
        self.graph = graph
        self.walk = walk
        self.calls = list(iter_calls(walk.body))
        self.ids = {id(c): f"c{i}" for i, c in enumerate(self.calls)}
        self.edges: list[tuple[str, str, str, bool]] = []  # (src id, dst id, label, back edge)
        writer: dict[str, str] = {name: f"in_{name}" for name in walk.inputs}
        seen: set[tuple[str, str, str]] = set()
        first_writer: dict[str, str] = {}
        for call in self.calls:
            for out in graph.nodes[call.node].outputs:
                first_writer.setdefault(call.env_output(out), self.ids[id(call)])
        for call in self.calls:
            node = graph.nodes[call.node]
            cid = self.ids[id(call)]
            for port in node.all_inputs:
                name = call.env_input(port)
                src = writer.get(name)
                if src is not None and (src, cid, name) not in seen:
                    seen.add((src, cid, name))
                    self.edges.append((src, cid, name, False))
            for out in node.outputs:
                writer[call.env_output(out)] = cid
        # back edges of loops: a later call writes a name an earlier call in the same loop reads
        for step in _loops(walk.body):
            body_calls = list(iter_calls(step.body))
            for i, call in enumerate(body_calls):
                for port in graph.nodes[call.node].all_inputs:
                    name = step.carry.get(call.env_input(port), call.env_input(port))
                    for later in body_calls[i:]:
                        outs = {later.env_output(o) for o in graph.nodes[later.node].outputs}
                        carried = {step.carry.get(o, o) for o in outs}
                        if call.env_input(port) in outs | carried and name:
                            key = (self.ids[id(later)], self.ids[id(call)], call.env_input(port))
                            if key not in seen:
                                seen.add(key)
                                self.edges.append((*key, True))
        self.streams = []
        for k, edge in enumerate(walk.streams):
            src = [c for c in self.calls if c.node == edge.src_node]
            policy = type(edge.policy).__name__ if edge.policy is not None else "NO POLICY"
            args = ", ".join(f"{v}" for v in _policy_args(edge.policy))
            self.streams.append((self.ids[id(src[-1])] if src else f"in_{edge.src_node}", f"s{k}", edge, f"{policy}({args})"))


def _policy_args(policy) -> list:
    if policy is None:
        return []
    import attrs

    return [getattr(policy, f.name) for f in attrs.fields(type(policy))]


def _loops(step: Step):
    if isinstance(step, Loop | DynamicLoop):
        yield step
        yield from _loops(step.body)
    elif isinstance(step, Sequential):
        for s in step.steps:
            yield from _loops(s)
    elif isinstance(step, Parallel):
        for s in step.branches:
            yield from _loops(s)


def _walk_tree(step: Step, layout: _Layout, visit_call: Callable, open_group: Callable, close: Callable, k=None):
    if k is None:
        k = [0]
    if isinstance(step, NodeCall):
        visit_call(step)
        return
    children = step.steps if isinstance(step, Sequential) else step.branches if isinstance(step, Parallel) else (step.body,)
    grouped = not isinstance(step, Sequential)
    if grouped:
        k[0] += 1
        open_group(f"g{k[0]}", _label_of(step))
    for child in children:
        _walk_tree(child, layout, visit_call, open_group, close, k)
    if grouped:
        close()


def _node_label(layout: _Layout, call: NodeCall) -> str:
    node = layout.graph.nodes[call.node]
    opts = ", ".join(f"{k}={v}" for k, v in call.options.items())
    return f"{call.node} [{node.engine}]" + (f" {opts}" if opts else "")


def to_mermaid(graph: Graph, walk_name: str) -> str:
    """Mermaid flowchart of one walk."""
    layout = _Layout(graph, graph.walks[walk_name])
    lines = ["flowchart TD", f'  subgraph walk_{walk_name}["walk: {walk_name}"]']
    depth = [2]

    def pad() -> str:
        return "  " * depth[0]

    for name in layout.walk.inputs:
        lines.append(f'{pad()}in_{name}(["{name}"])')

    def visit(call: NodeCall) -> None:
        lines.append(f'{pad()}{layout.ids[id(call)]}["{_node_label(layout, call)}"]')

    def open_group(gid: str, label: str) -> None:
        lines.append(f'{pad()}subgraph {gid}["{label}"]')
        depth[0] += 1

    def close() -> None:
        depth[0] -= 1
        lines.append(f"{pad()}end")

    _walk_tree(layout.walk.body, layout, visit, open_group, close, [0])
    for _src, sid, edge, _label in layout.streams:
        lines.append(f'{pad()}{sid}["{edge.dst_node} [{graph.nodes[edge.dst_node].engine}] (stream)"]')
    lines.append("  end")
    for src, dst, label, back in layout.edges:
        arrow = f'-. "{label} (next iter)" .->' if back else f'-- "{label}" -->'
        lines.append(f"  {src} {arrow} {dst}")
    for src, sid, edge, policy in layout.streams:
        lines.append(f'  {src} == "{edge.src_output} ~ {policy}" ==> {sid}')
    return "\n".join(lines) + "\n"


def to_dot(graph: Graph, walk_name: str) -> str:
    """Graphviz DOT digraph of one walk."""
    layout = _Layout(graph, graph.walks[walk_name])
    lines = [f'digraph "{walk_name}" {{', "  rankdir=TB;", "  node [shape=box];"]
    depth = [1]

    def pad() -> str:
        return "  " * depth[0]

    for name in layout.walk.inputs:
        lines.append(f'{pad()}in_{name} [label="{name}", shape=ellipse];')

    def visit(call: NodeCall) -> None:
        lines.append(f'{pad()}{layout.ids[id(call)]} [label="{_node_label(layout, call)}"];')

    def open_group(gid: str, label: str) -> None:
        lines.append(f'{pad()}subgraph cluster_{gid} {{')
        depth[0] += 1
        lines.append(f'{pad()}label="{label}";')

    def close() -> None:
        depth[0] -= 1
        lines.append(f"{pad()}}}")

    _walk_tree(layout.walk.body, layout, visit, open_group, close, [0])
    for _src, sid, edge, _label in layout.streams:
        lines.append(f'{pad()}{sid} [label="{edge.dst_node} [{graph.nodes[edge.dst_node].engine}] (stream)"];')
    for src, dst, label, back in layout.edges:
        style = ', style=dashed, constraint=false' if back else ""
        lines.append(f'  {src} -> {dst} [label="{label}"{style}];')
    for src, sid, edge, policy in layout.streams:
        lines.append(f'  {src} -> {sid} [label="{edge.src_output} ~ {policy}", style=bold];')
    lines.append("}")
    return "\n".join(lines) + "\n"
