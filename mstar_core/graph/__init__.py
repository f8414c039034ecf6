"""The Walk Graph: nodes, walks built from four primitives, streaming edges, validation, rendering."""

from mstar_core.graph.graph import Graph
from mstar_core.graph.node import GraphEdge, GraphNode
from mstar_core.graph.render import to_dot, to_mermaid
from mstar_core.graph.walk import (
    DynamicLoop,
    Loop,
    NodeCall,
    Parallel,
    Sequential,
    StreamingGraphEdge,
    Walk,
)

__all__ = [
    "DynamicLoop",
    "Graph",
    "GraphEdge",
    "GraphNode",
    "Loop",
    "NodeCall",
    "Parallel",
    "Sequential",
    "StreamingGraphEdge",
    "Walk",
    "to_dot",
    "to_mermaid",
]
