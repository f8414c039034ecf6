"""`GrammarVocab`: a model's tokens as raw bytes, what a grammar compiles against."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from mstar_core.grammar.pieces import BYTE_PIECE, byte_level_alphabet


@attrs.frozen(eq=False)
class GrammarVocab:
    """Each token id's bytes (special tokens as b"", so no grammar ever emits them as text), the ids that
    end a finished grammar's output, the model's vocabulary size (logit columns, padding included), and the ids
    below it that no token stands for (embedding rows padded past the tokenizer: the engine never samples them)."""

    token_bytes: tuple[bytes, ...]
    stop_ids: tuple[int, ...]
    vocab_size: int
    no_token_ids: tuple[int, ...] = ()

    @property
    def fingerprint(self) -> str:
        """Names this vocabulary in caches: two models with the same tokens share compiled grammars."""
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{self.vocab_size}:{self.stop_ids}".encode())
        for piece in self.token_bytes:
            h.update(len(piece).to_bytes(4, "little"))
            h.update(piece)
        return h.hexdigest()

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int],
                       special_ids: Sequence[int] = ()) -> GrammarVocab:
        """From a `tokenizers.Tokenizer`: byte-level pieces through GPT-2's alphabet, `<0xAB>` pieces as their
        byte, others as their text's UTF-8; its added special tokens (and `special_ids`) as b"". Ids below
        `vocab_size` the tokenizer lacks (real checkpoints pad their embeddings, Qwen2's 151936 rows for ~151665
        tokens) are `no_token_ids`."""
        specials = set(special_ids)
        decoder = getattr(tokenizer, "get_added_tokens_decoder", None)
        if decoder is not None:
            specials |= {i for i, tok in decoder().items() if getattr(tok, "special", False)}
        pieces = [b""] * vocab_size  # padded embedding rows and unknown ids are never text
        ids = tokenizer.get_vocab(with_added_tokens=True)
        for piece, i in ids.items():
            if 0 <= i < vocab_size and i not in specials:
                pieces[i] = _bytes_of(tokenizer, piece, i)
        no_token = sorted(set(range(vocab_size)).difference(ids.values()))
        return cls(tuple(pieces), tuple(int(t) for t in stop_ids), int(vocab_size), tuple(no_token))


def _bytes_of(tokenizer: Any, piece: str, token_id: int) -> bytes:
    """One token's bytes from its vocabulary piece (no decode call for byte-level and SentencePiece pieces)."""
    if type(getattr(tokenizer, "decoder", None)).__name__ == "ByteLevel":
        alphabet = byte_level_alphabet()
        if all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
    match = BYTE_PIECE.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    if "\u2581" in piece:  # SentencePiece's word-start marker is a space
        return piece.replace("\u2581", " ").encode()
    return tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8", errors="replace")
