"""The Walk Graph: nodes, walks built from four primitives, streaming edges, validation, rendering."""

from mstar_core.graph.graph import Branch, Graph
from mstar_core.graph.node import GraphEdge, GraphNode
from mstar_core.graph.render import to_dot, to_mermaid
from mstar_core.graph.walk import (
    Assign,
    Copy,
    DynamicLoop,
    FromEnv,
    Loop,
    NodeCall,
    Parallel,
    Rename,
    Sequential,
    StreamingGraphEdge,
    StreamPriority,
    StreamProgress,
    Walk,
    stream_priority,
)

__all__ = [
    "Assign",
    "Branch",
    "Copy",
    "DynamicLoop",
    "FromEnv",
    "Graph",
    "GraphEdge",
    "GraphNode",
    "Loop",
    "NodeCall",
    "Parallel",
    "Rename",
    "Sequential",
    "StreamPriority",
    "StreamProgress",
    "StreamingGraphEdge",
    "Walk",
    "stream_priority",
    "to_dot",
    "to_mermaid",
]
