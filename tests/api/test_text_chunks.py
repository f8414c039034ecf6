"""`TextChunker` (the speech stream route's text policy): segments at sentence ends, at clause boundaries once long
enough, after a word count otherwise; nothing lost or repeated however the text is split into pieces."""

from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_core.api.requests.text_chunks import TextChunker


def _feed(chunker, pieces):
    out = []
    for piece in pieces:
        out += chunker.push(piece)
    return out, out + chunker.flush()


def test_sentences_clauses_and_the_word_count_fallback():
    chunker = TextChunker(min_clause_words=3, max_words=8)
    text = "Hi. The value is 3.14 today! Well, I think, that we should go now and then some more words here"
    _, segments = _feed(chunker, [text[i:i + 4] for i in range(0, len(text), 4)])
    assert segments == ["Hi. ", "The value is 3.14 today! ", "Well, I think, ",
                        "that we should go now and then some ", "more words here"]


def test_a_boundary_at_the_end_waits_for_the_next_piece():
    chunker = TextChunker()
    assert chunker.push("It costs 3.") == []  # may become 3.14
    assert chunker.push("14 dollars. Then") == ["It costs 3.14 dollars. "]
    assert chunker.flush() == ["Then"]
    assert chunker.push("你好。世界") == ["你好。"]  # CJK ends need no space
    assert chunker.cancel() == "世界" and chunker.flush() == []


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="ab ,.!?;:\n。，", max_size=200), st.lists(st.integers(1, 9), min_size=1, max_size=40))
def test_nothing_is_lost_or_repeated(text, cuts):
    pieces, at = [], 0
    for n in cuts:
        pieces.append(text[at:at + n])
        at += n
    pieces.append(text[at:])
    early, everything = _feed(TextChunker(min_clause_words=2, max_words=5), pieces)
    assert "".join(everything) == text
    assert all(s for s in everything)
