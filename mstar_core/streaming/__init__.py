"""Streaming edges' chunk policies."""

from mstar_core.streaming.policies import (
    Chunk,
    ChunkPolicy,
    ChunkStream,
    FixedChunkPolicy,
    LeftContextChunkPolicy,
    SlidingWindowChunkPolicy,
)

__all__ = [
    "Chunk",
    "ChunkPolicy",
    "ChunkStream",
    "FixedChunkPolicy",
    "LeftContextChunkPolicy",
    "SlidingWindowChunkPolicy",
]
