"""Draft proposers for speculative decoding: guesses of a sequence's next tokens, checked by the target model.

A proposer only guesses; `speculative.py` verifies the guesses in one forward of the target model and keeps
exactly the tokens plain decoding would have produced (or, sampling, drawn with the same distribution).
"""

from __future__ import annotations

from array import array


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n tokens.

    Tries n from `max_ngram` down to `min_ngram`; the longest suffix seen before wins (a longer match is a
    surer guess). Editing, summarising, quoting and code continuation repeat spans of their own context, which
    is where this pays; on text that does not repeat it finds nothing and costs one substring search.
    """

    def __init__(self, max_ngram: int, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` guessed next tokens of `tokens` (none when no suffix occurred before)."""
        length = len(tokens)
        if k < 1 or length < self.min_ngram + 1:
            return []
        # one int64 per token: bytes.rfind searches in C (a Python scan of a 2k-token context per step costs ms)
        data = array("q", tokens).tobytes()
        width = 8
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            suffix = data[(length - n) * width:]
            end = (length - 1) * width  # a match must end before the last token: the suffix itself is no match
            while True:
                at = data.rfind(suffix, 0, end)
                if at < 0:
                    break
                if at % width == 0:  # aligned on a token, not straddling two
                    start = at // width + n
                    return tokens[start : start + k]
                end = at + len(suffix) - 1
        return []
