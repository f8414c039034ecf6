"""`TokenIds`: a sequence's token list mirrored in a long tensor, extended in place as tokens are appended."""

from __future__ import annotations

import torch


class TokenIds:
    """The repetition penalty's view of a sequence's tokens, without rebuilding a tensor from the list every step.

    Converting the whole list (prompt plus everything generated) cost a Python pass over every id
    per step and row; the mirror only copies what was appended since the last call. The owner
    drops it when its list shrinks or is copied (`BlockManager.truncate`, `fork`): a mirror trusts
    that the first `n` ids it copied are still the list's first `n`.
    """

    def __init__(self):
        self.buf = torch.empty(0, dtype=torch.long)
        self.n = 0

    def of(self, tokens: list[int]) -> torch.Tensor:
        """`tokens` as a 1-D long tensor (a view of the mirror: valid until the list changes)."""
        m = len(tokens)
        if m < self.n:  # shrank without the owner dropping the mirror: copy it all again
            self.n = 0
        if m > self.buf.shape[0]:  # doubling: a copy of the mirror now and then, not per token
            grown = torch.empty(max(m, 2 * self.buf.shape[0], 64), dtype=torch.long)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        if m == self.n + 1:
            self.buf[self.n] = tokens[self.n]
        elif m > self.n:
            self.buf[self.n : m] = torch.tensor(tokens[self.n : m], dtype=torch.long)
        self.n = m
        return self.buf[:m]
