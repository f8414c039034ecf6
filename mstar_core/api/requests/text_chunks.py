"""`TextChunker` lives in `mstar_core.streaming.text_chunks` (the kernel: the `TextChunkPolicy` of a composed
model's text stream cuts with it too); this path stays for the routes that import it here."""

from mstar_core.streaming.text_chunks import (
    CJK_CLAUSE_ENDS,
    CJK_SENTENCE_ENDS,
    CLAUSE_ENDS,
    SENTENCE_ENDS,
    TextChunker,
)

__all__ = ["CJK_CLAUSE_ENDS", "CJK_SENTENCE_ENDS", "CLAUSE_ENDS", "SENTENCE_ENDS", "TextChunker"]
