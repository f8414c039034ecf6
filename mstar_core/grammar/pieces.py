"""A token's raw bytes from its vocabulary piece: GPT-2's byte-level alphabet, SentencePiece's `<0xAB>` pieces."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


def piece_bytes(tokenizer: Any, token_id: int) -> bytes:
    """A token's raw bytes: through the byte-level alphabet (GPT-2-style BPE), a `<0xAB>` byte piece
    (SentencePiece), or else the UTF-8 of its decoded text."""
    piece = tokenizer.id_to_token(token_id)
    if piece is not None:
        match = BYTE_PIECE.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        alphabet = byte_level_alphabet()
        decoder = type(getattr(tokenizer, "decoder", None)).__name__
        if decoder == "ByteLevel" and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
    return tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8", errors="replace")
