"""`TextChunkPolicy`: a token stream released in pieces a TTS can start speaking (sentences, long clauses).

The items are token ids (an LM's sampled tokens); the policy decodes what it holds with the `decode` it is given
(the LM's tokenizer) and cuts where `TextChunker` would cut the text: after a sentence end, after a clause boundary
once the piece holds `min_clause_words` words, or after `max_words` words with no boundary in sight. A cut falls on
a token boundary: the last token that ends at or before the cut in the text closes the chunk, so a token that
straddles it (`" The"` after `"."`) opens the next. Every token is released exactly once, in order (no context
items); the producer's end flushes what is left as the final chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from mstar_core.streaming.policies import Chunk, ChunkPolicy, ChunkStream
from mstar_core.streaming.text_chunks import TextChunker


@attrs.frozen
class TextChunkPolicy(ChunkPolicy):
    """Fire on sentence (or long-clause) boundaries of the decoded text, with a word-count fallback."""

    decode: Callable[[Sequence[int]], str] = attrs.field(eq=False)
    min_clause_words: int = 6
    max_words: int = 24
    tail: str = "flush"

    def __attrs_post_init__(self) -> None:
        TextChunker(self.min_clause_words, self.max_words)  # its bounds, checked once here
        if self.tail != "flush":
            raise ValueError("TextChunkPolicy always flushes its tail: dropping the end of a reply loses words")

    def open(self) -> ChunkStream:
        return _TextStream(self)


class _TextStream(ChunkStream):
    def __init__(self, policy: TextChunkPolicy):
        super().__init__()
        self.policy = policy
        self.buffer: list[Any] = []

    def _push(self, item: Any) -> list[Chunk]:
        self.buffer.append(item)
        out = []
        while self.buffer and (cut := self._cut()) is not None:
            out.append(Chunk(tuple(self.buffer[:cut]), self.total - len(self.buffer), 0))
            self.buffer = self.buffer[cut:]
        return out

    def _close(self) -> list[Chunk]:
        if not self.buffer:
            return []
        chunk = Chunk(tuple(self.buffer), self.total - len(self.buffer), 0, final=True)
        self.buffer = []
        return [chunk]

    def _cut(self) -> int | None:
        """How many buffered tokens the next chunk takes, or None while the text has no cut yet."""
        decode = self.policy.decode
        text = decode(self.buffer)
        if text.endswith("\ufffd"):  # a character split across tokens: wait for its other bytes
            return None
        chunker = TextChunker(self.policy.min_clause_words, self.policy.max_words, buffer=text)
        at = chunker.next_cut()
        if at is None:
            return None
        lengths = [len(decode(self.buffer[:k])) for k in range(1, len(self.buffer) + 1)]
        within = [k for k, n in enumerate(lengths, 1) if n <= at]
        if within:
            return within[-1]
        return next(k for k, n in enumerate(lengths, 1) if n >= at)
