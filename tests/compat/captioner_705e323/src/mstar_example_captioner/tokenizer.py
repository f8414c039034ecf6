"""A character tokenizer: one id per printable ASCII character (its code point) plus four special tokens."""

from __future__ import annotations

from collections.abc import Iterable

PAD, BOS, EOS, IMAGE = 0, 1, 2, 3
NEWLINE = 10
PRINTABLE = range(32, 127)


class CharTokenizer:
    """`encode` refuses text it cannot represent (ValueError naming the character); `decode` skips specials."""

    specials = {"<pad>": PAD, "<bos>": BOS, "<eos>": EOS, "<image>": IMAGE}

    def encode(self, text: str) -> list[int]:
        ids = []
        for i, ch in enumerate(text):
            code = ord(ch)
            if code != NEWLINE and code not in PRINTABLE:
                raise ValueError(f"character {ch!r} at position {i} is not printable ASCII")
            ids.append(code)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(chr(i) for i in ids if i == NEWLINE or i in PRINTABLE)
