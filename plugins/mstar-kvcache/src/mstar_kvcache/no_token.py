"""Logit columns no token stands for (embedding rows padded past the tokenizer), put at -inf before sampling.

Real checkpoints round their vocabulary up (Qwen2: 151936 rows for ~151665 tokens) and the tiny presets do the
same. Those rows were never trained toward anything, so random or fine-tuned weights can give them mass; a
sampled one decodes to nothing, and a reply can run to `max_tokens` with no text at all. The columns come from
the module's `grammar_vocab` (`GrammarVocab.no_token_ids`, what every model with a tokenizer hands the engine),
sorted once at load: a step pays one strided fill of the padded tail, plus one `index_fill_` for holes below it.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch


@attrs.frozen(eq=False)
class NoTokenColumns:
    """The padded tail `[tail, width)` of the logits, and any ids below it with no token (`holes`)."""

    tail: int
    holes: torch.Tensor | None

    @classmethod
    def of(cls, vocab: Any, width: int | None, device: torch.device) -> NoTokenColumns | None:
        """From a `GrammarVocab` (None: the module has no tokenizer, nothing is masked) for logits `width` wide."""
        ids = sorted(getattr(vocab, "no_token_ids", ()) or ())
        width = int(width or getattr(vocab, "vocab_size", 0) or 0)
        ids = [i for i in ids if 0 <= i < width]
        if not ids or len(ids) == width:  # nothing to mask, or nothing left to sample: leave the model as it is
            return None
        tail = width
        while ids and ids[-1] == tail - 1:
            tail -= 1
            ids.pop()
        return cls(tail, torch.tensor(ids, dtype=torch.long, device=device) if ids else None)

    def fill(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` `[N, width]` with these columns at -inf, in place (a module's `compute_logits` returns a
        fresh tensor every step), so neither the draw, greedy argmax nor top log-probabilities can pick them."""
        logits[:, self.tail:] = float("-inf")
        if self.holes is not None:
            logits.index_fill_(1, self.holes, float("-inf"))
        return logits
