"""`TextChunker`: text arriving in pieces (as an LLM writes it) cut into segments a TTS can start speaking.

A segment ends at a sentence end (`.`, `!`, `?` followed by whitespace; CJK `。！？` at once), at a clause boundary
(`,` `;` `:` followed by whitespace; CJK `，；：、`) once the segment holds `min_clause_words` words, or, with no
boundary in sight, after `max_words` words (at the whitespace that follows the last of them). A boundary at the very
end of the text so far waits for the next piece (`3.` may become `3.14`). `flush` ends the text: the rest is one
last segment. Concatenating the segments gives back every character pushed, in order: nothing is dropped or
repeated (the caller skips segments that are only whitespace).
"""

from __future__ import annotations

import attrs

SENTENCE_ENDS = ".!?"
CLAUSE_ENDS = ",;:"
CJK_SENTENCE_ENDS = "。！？"
CJK_CLAUSE_ENDS = "，；：、"


@attrs.define
class TextChunker:
    min_clause_words: int = 6
    max_words: int = 24
    buffer: str = ""

    def __attrs_post_init__(self) -> None:
        if self.min_clause_words < 1 or self.max_words < self.min_clause_words:
            raise ValueError("TextChunker needs 1 <= min_clause_words <= max_words")

    def push(self, text: str) -> list[str]:
        self.buffer += text
        out = []
        while (cut := self.next_cut()) is not None:
            out.append(self.buffer[:cut])
            self.buffer = self.buffer[cut:]
        return out

    def flush(self) -> list[str]:
        out = self.push("")
        if self.buffer:
            out.append(self.buffer)
        self.buffer = ""
        return out

    def cancel(self) -> str:
        """Drop the text not yet cut; returns it."""
        dropped, self.buffer = self.buffer, ""
        return dropped

    def next_cut(self) -> int | None:
        """Index just past the first boundary the buffer allows now, or None."""
        text, words, in_word = self.buffer, 0, False
        for i, ch in enumerate(text):
            if ch.isspace():
                if in_word:
                    words += 1
                    in_word = False
                    if words >= self.max_words:
                        return i + 1
                continue
            in_word = True
            after = text[i + 1] if i + 1 < len(text) else ""
            spaced = after.isspace()
            if ch in CJK_SENTENCE_ENDS or (ch in SENTENCE_ENDS and spaced):
                return i + 2 if spaced else i + 1
            counted = words + 1  # the word this boundary closes
            if counted >= self.min_clause_words and (ch in CJK_CLAUSE_ENDS or (ch in CLAUSE_ENDS and spaced)):
                return i + 2 if spaced else i + 1
        return None
