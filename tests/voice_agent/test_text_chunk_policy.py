"""`TextChunkPolicy`: a token stream cut where the decoded text has a sentence (or long clause) end, with a word
bound; every token released exactly once, in order, the tail flushed at the producer's end."""

from __future__ import annotations

import random

import pytest

from mstar_core.streaming import TextChunkPolicy

# a toy vocabulary: each id decodes to one piece of text (as a BPE tokenizer's pieces do)
PIECES = ["Hello", " there", ".", " How", " are", " you", "?", " I", " am", " fine", ",", " thanks", " for",
          " asking", " a", " b", " c", "\n", " "]


def decode(ids):
    return "".join(PIECES[i] for i in ids)


def ids_of(*pieces):
    return [PIECES.index(p) for p in pieces]


def run(policy, ids):
    stream = policy.open()
    chunks = [c for i in ids for c in stream.push(i)]
    return chunks, stream.close()


def test_cuts_after_a_sentence_end_once_the_next_token_shows_whitespace_and_flushes_the_rest():
    ids = ids_of("Hello", " there", ".", " How", " are", " you", "?")
    chunks, tail = run(TextChunkPolicy(decode), ids)
    assert [decode(c.items) for c in chunks] == ["Hello there."]  # cut when " How" arrived, on its left
    assert [decode(c.items) for c in tail] == [" How are you?"] and tail[0].final
    assert chunks[0].num_context == 0 and chunks[0].start == 0 and tail[0].start == 3


def test_a_clause_ends_a_chunk_only_once_it_holds_enough_words_and_the_word_bound_cuts_without_any():
    short = ids_of(" I", " am", ",", " fine")
    assert run(TextChunkPolicy(decode, min_clause_words=6), short)[0] == []
    assert [decode(c.items) for c in run(TextChunkPolicy(decode, min_clause_words=2), short)[0]] == [" I am,"]
    words = ids_of(*([" a", " b", " c"] * 4))
    chunks, tail = run(TextChunkPolicy(decode, min_clause_words=2, max_words=5), words)
    assert [decode(c.items) for c in chunks] == [" a b c a b", " c a b c a"]
    assert decode(tail[0].items) == " b c"


def test_a_character_split_across_tokens_waits_for_its_other_bytes():
    pieces = {0: "Yes.", 1: " \ufffd", 2: " Ok"}  # 1: half of a character (what a byte-level decode shows)

    def partial(ids):
        text = "".join(pieces[i] for i in ids)
        return text[:-1] + "é" if ids and ids[-1] == 2 and 1 in ids else text

    stream = TextChunkPolicy(partial).open()
    assert stream.push(0) == [] and stream.push(1) == []  # "Yes. \ufffd": no cut while a character is cut in two
    assert [c.items for c in stream.push(2)] == [(0,)]


@pytest.mark.parametrize("seed", range(30))
def test_every_token_is_released_exactly_once_in_order(seed):
    rng = random.Random(seed)
    ids = [rng.randrange(len(PIECES)) for _ in range(rng.randrange(0, 80))]
    chunks, tail = run(TextChunkPolicy(decode, min_clause_words=rng.randint(1, 4), max_words=rng.randint(4, 9)), ids)
    released = [t for c in [*chunks, *tail] for t in c.new_items]
    assert released == ids
    assert all(c.num_context == 0 for c in [*chunks, *tail])
    assert [c.start for c in [*chunks, *tail]] == [sum(len(c.items) for c in [*chunks, *tail][:k])
                                                  for k in range(len(chunks) + len(tail))]


def test_it_never_drops_a_tail():
    with pytest.raises(ValueError, match="flushes its tail"):
        TextChunkPolicy(decode, tail="drop")
    with pytest.raises(ValueError, match="min_clause_words"):
        TextChunkPolicy(decode, min_clause_words=10, max_words=5)
