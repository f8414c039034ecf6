"""Streaming edges' chunk policies."""

from mstar_core.streaming.policies import (
    Chunk,
    ChunkPolicy,
    ChunkStream,
    FixedChunkPolicy,
    LeftContextChunkPolicy,
    SlidingWindowChunkPolicy,
)
from mstar_core.streaming.text import TextChunkPolicy

__all__ = [
    "Chunk",
    "ChunkPolicy",
    "ChunkStream",
    "FixedChunkPolicy",
    "LeftContextChunkPolicy",
    "SlidingWindowChunkPolicy",
    "TextChunkPolicy",
]
