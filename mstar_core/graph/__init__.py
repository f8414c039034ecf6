"""The Walk Graph: nodes, walks built from four primitives, streaming edges, validation, rendering."""

from mstar_core.graph.graph import Branch, Graph
from mstar_core.graph.node import GraphEdge, GraphNode
from mstar_core.graph.render import to_dot, to_mermaid
from mstar_core.graph.walk import (
    DynamicLoop,
    FromEnv,
    Loop,
    NodeCall,
    Parallel,
    Sequential,
    StreamingGraphEdge,
    StreamProgress,
    Walk,
    stream_priority,
)

__all__ = [
    "Branch",
    "DynamicLoop",
    "FromEnv",
    "Graph",
    "GraphEdge",
    "GraphNode",
    "Loop",
    "NodeCall",
    "Parallel",
    "Sequential",
    "StreamProgress",
    "StreamingGraphEdge",
    "Walk",
    "stream_priority",
    "to_dot",
    "to_mermaid",
]
