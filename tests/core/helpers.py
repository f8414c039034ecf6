"""Small graphs and functions shared by the core tests."""

from mstar_core.graph import GraphNode


def fn_node(name, inputs, outputs, fn, **kw):
    """A node on the function engine wrapping a plain callable."""
    return GraphNode(name, inputs=inputs, outputs=outputs, engine="function", module=lambda: fn, **kw)


def identity(**kw):
    return dict(kw)
