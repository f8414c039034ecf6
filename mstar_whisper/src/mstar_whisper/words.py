"""Text tokens with times -> words with times, grouped as openai-whisper groups them.

Tokens join into whole characters first (a character's UTF-8 bytes may span tokens); a word starts at a piece that
begins with a space or is punctuation (languages written without spaces split at every character instead). A word
runs from its first token's start to its last token's end. Then punctuation merges into its neighbour: opening marks
(`"'“¿([{-`) written with a space before them join the next word, closing marks (`"'.。,，!！?？:：”)]}、`) join the
word before; a merged word keeps its own times, the mark's are dropped (openai-whisper's `merge_punctuations`).
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence

import attrs

PREPEND_PUNCTUATIONS = "\"'“¿([{-"
APPEND_PUNCTUATIONS = "\"'.。,，!！?？:：”)]}、"
#: openai-whisper's languages written without spaces between words
UNSPACED_LANGUAGES = {"zh", "ja", "th", "lo", "my", "yue"}


@attrs.define
class Word:
    word: str
    start: float
    end: float
    tokens: list[int]


def _unicode_pieces(tokens: Sequence[int], decode: Callable[[list[int]], str]) -> list[list[int]]:
    """Runs of tokens that decode to whole characters."""
    pieces, current = [], []
    for tok in tokens:
        current.append(tok)
        if "\ufffd" not in decode(current):
            pieces.append(current)
            current = []
    if current:  # (bytes that never complete a character: their own piece)
        pieces.append(current)
    return pieces


def split_words(tokens: Sequence[int], decode: Callable[[list[int]], str], language: str | None = None) -> list[list[int]]:
    """`tokens` (text only) as the token runs of its words."""
    pieces = _unicode_pieces(tokens, decode)
    if language in UNSPACED_LANGUAGES:
        return pieces
    words: list[list[int]] = []
    for piece in pieces:
        text = decode(piece)
        if not words or text.startswith(" ") or text.strip() in string.punctuation:
            words.append(list(piece))
        else:
            words[-1].extend(piece)
    return words


def merge_punctuations(words: list[Word]) -> list[Word]:
    """openai-whisper's merge: opening marks into the next word, closing marks into the one before; empties dropped."""
    i, j = len(words) - 2, len(words) - 1
    while i >= 0:
        previous, following = words[i], words[j]
        if previous.word.startswith(" ") and previous.word.strip() in PREPEND_PUNCTUATIONS:
            following.word, following.tokens = previous.word + following.word, previous.tokens + following.tokens
            previous.word, previous.tokens = "", []
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(words):
        previous, following = words[i], words[j]
        if not previous.word.endswith(" ") and following.word in APPEND_PUNCTUATIONS:
            previous.word, previous.tokens = previous.word + following.word, previous.tokens + following.tokens
            following.word, following.tokens = "", []
        else:
            i = j
        j += 1
    return [w for w in words if w.word]


def timed_words(token_times: Sequence[tuple[int, float, float]], decode: Callable[[list[int]], str], offset: float,
                limit: float, language: str | None = None) -> list[Word]:
    """`(token, start, end)` of a window's text (window-relative seconds) -> its words, `offset` seconds in, no time
    past `limit` (the audio's end)."""
    tokens = [int(t) for t, _, _ in token_times]
    words, at = [], 0
    for run in split_words(tokens, decode, language):
        start, end = token_times[at][1], token_times[at + len(run) - 1][2]
        at += len(run)
        words.append(Word(decode(run), min(offset + start, limit), min(offset + end, limit), run))
    return merge_punctuations(words)
