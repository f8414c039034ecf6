"""`TokenIds`: a sequence's token list mirrored as an int64 array, extended in place as tokens are appended."""

from __future__ import annotations

from array import array


class TokenIds:
    """The repetition penalty's view of a sequence's tokens, without converting the whole list every step.

    The penalty reads every id the sequence holds (prompt and generated), so converting the list
    each step cost a pass over all of them per row (8 rows of 1,000 ids: ~1.7 ms through
    `torch.tensor`); the mirror copies only what was appended since the last call, and the sampler
    turns the rows' arrays into one tensor with a byte copy. The owner drops the mirror when its
    list shrinks or is copied (`BlockManager.truncate`, `fork`): a mirror trusts that the first `n`
    ids it copied are still the list's first `n`.
    """

    def __init__(self):
        self.ids = array("q")

    def of(self, tokens: list[int]) -> array:
        """`tokens` as an int64 array (the mirror itself: read it before the list changes again)."""
        n = len(self.ids)
        if len(tokens) < n:  # shrank without the owner dropping the mirror: copy it all again
            del self.ids[:]
            n = 0
        if len(tokens) > n:
            self.ids.extend(tokens[n:])
        return self.ids
