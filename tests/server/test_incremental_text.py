"""`IncrementalText`: decoding a window per generated id gives, at every step, the text a full decode gives."""

from __future__ import annotations

import random

import pytest

from mstar_core.api.requests.text import IncrementalText, TextAssembler


def _bytes_decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def _assert_matches_full_decode(decode, ids):
    text = IncrementalText(decode)
    for i, token in enumerate(ids):
        assert text.append(token) == decode(ids[:i + 1]), f"after {i + 1} ids"


@pytest.mark.parametrize("seed", range(5))
def test_one_byte_tokens_match_a_full_decode_even_over_invalid_bytes(seed):
    rng = random.Random(seed)
    words = "plain ascii, é, ✓, 海, 🙂 ".encode()
    ids = [rng.choice(words) if rng.random() < 0.8 else rng.randrange(256) for _ in range(300)]
    _assert_matches_full_decode(_bytes_decode, ids)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from mstar_llm.preset import smollm2_gguf

    from mstar_core.checkpoint import gguf_tokenizer
    from mstar_core.checkpoint.gguf import GGUFSource

    return gguf_tokenizer(GGUFSource(smollm2_gguf()).metadata)


def test_a_real_tokenizer_matches_a_full_decode(smollm2_tokenizer):
    """SmolLM2's byte-level BPE: encoded text with multi-byte characters split across ids, specials among them,
    and random ids from the whole vocabulary (pieces of characters run on for several ids)."""
    tok = smollm2_tokenizer

    def decode(ids):
        return tok.decode(list(ids), skip_special_tokens=True)

    text = "The sea 🌊 is vast. Über straße, 海の水, naïve café — «done».\n\n  Spaces   and\ttabs 🙂🙂"
    ids = tok.encode(text).ids
    assert len(ids) > 30
    _assert_matches_full_decode(decode, ids)
    assert IncrementalText(decode).append(ids[0]) == decode(ids[:1])
    rng = random.Random(0)
    vocab = tok.get_vocab_size()
    for _ in range(3):
        _assert_matches_full_decode(decode, [rng.randrange(vocab) for _ in range(120)])
    _assert_matches_full_decode(decode, [0, *ids[:8], 1, 2, *ids[8:]])  # special tokens (dropped) in between


def test_a_window_that_would_change_settled_text_falls_back_to_a_full_decode():
    """A decoder that rewrites text across ids (here: "a" then "b" reads "X") is followed exactly."""

    def decode(ids):
        return "".join(chr(i) for i in ids).replace("ab", "X")

    _assert_matches_full_decode(decode, [ord(c) for c in "cabbage and a bab"])


def test_the_assembler_decodes_a_window_not_the_whole_reply():
    """Each step decodes a few ids, however long the reply (it decoded all of them before: quadratic)."""
    lengths = []

    def decode(ids):
        lengths.append(len(ids))
        return _bytes_decode(ids)

    class Adapter:
        detokenize = staticmethod(decode)

        def is_stop_token(self, token_id):
            return False

    asm = TextAssembler(Adapter(), ("STOP",))
    reply = ("word " * 400).encode()
    pieces = [asm.feed(b) for b in reply]
    assert "".join(pieces) + asm.close({}) == reply.decode()
    assert max(lengths) <= 4 and sum(lengths) < 3 * len(reply)
