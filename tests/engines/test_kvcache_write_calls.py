"""A call without `sampling` (a prompt write whose token the walk drops) keeps nothing: the label's generated
tokens, its `max_tokens` count and its grammar see only the tokens sampling calls drew."""

from __future__ import annotations

import pytest

from tests.engines.paged_tiny import LM_NODE, VOCAB, TinyNode, engine_for, run

pytest.importorskip("xgrammar")

PROMPT = [3, 9, 14, 1, 22, 7, 30, 5]
#: token 0 is the stop token (no text); token i > 0 is one character: a letter, a digit or "-"
PIECES = (b"", *(bytes([c]) for c in b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-"))
assert len(PIECES) == VOCAB


def _engine():
    from mstar_core.grammar import GrammarVocab

    module = TinyNode()
    module.grammar_vocab = GrammarVocab(PIECES, (0,), VOCAB)
    return engine_for(module, LM_NODE)


def _grammar_without(token: int) -> list[str]:
    """A regex grammar of three letters that never allows `token`'s letter (so a matcher fed it would fail)."""
    letters = "".join(p.decode() for i, p in enumerate(PIECES) if i and i != token and p.isalpha())
    return ["regex", f"[{letters}]{{3}}"]


def _decode(engine, rid: str, first: list[int], sampling: dict) -> tuple[list[int], str | None]:
    out = run(engine, rid, {"input_ids": first, "sampling": sampling})
    tokens = [out["next_token"]]
    while out["finish_reason"] is None:
        out = run(engine, rid, {"input_ids": [tokens[-1]], "sampling": sampling})
        tokens.append(out["next_token"])
    return tokens, out["finish_reason"]


def test_a_write_token_is_not_generated_and_the_grammar_never_sees_it():
    engine = _engine()
    dropped = run(engine, "a", {"input_ids": PROMPT})["next_token"]  # no sampling: a prompt write
    assert engine.seqs["a", "main"].generated == []
    grammar = _grammar_without(dropped)
    tokens, reason = _decode(engine, "a", [1], {"temperature": 0.9, "seed": 3, "max_tokens": 10, "grammar": grammar})
    text = b"".join(PIECES[t] for t in tokens).decode()
    assert reason == "stop" and tokens[-1] == 0 and len(text) == 3 and PIECES[dropped].decode() not in text
    assert engine.seqs["a", "main"].generated == tokens
    # a write between sampling calls (the label's sampling still set) leaves its matcher where it was
    engine.release("a")
    run(engine, "b", {"input_ids": PROMPT})
    greedy = {"temperature": 0, "max_tokens": 4, "grammar": grammar}
    first = run(engine, "b", {"input_ids": [1], "sampling": greedy})["next_token"]
    run(engine, "b", {"input_ids": [first]})
    rest, reason = _decode(engine, "b", [2], greedy)
    assert engine.seqs["b", "main"].generated == [first, *rest]
    assert reason == "stop" and len(b"".join(PIECES[t] for t in [first, *rest])) == 3

def test_max_tokens_counts_only_sampled_tokens():
    engine = _engine()
    for _ in range(3):  # three prompt writes on one label, then a reply of exactly max_tokens tokens
        run(engine, "a", {"input_ids": PROMPT})
    tokens, reason = _decode(engine, "a", [1], {"temperature": 0, "max_tokens": 5, "logit_bias": {"0": -100}})
    assert len(tokens) == 5 and reason == "length"
