"""Grammar-constrained sampling on the paged-KV engine (tiny Llama preset): each row masked alone, rows without a
grammar drawing exactly what they draw alone, forks and preemption keeping their matchers, bad specs refused."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from mstar_core.model import LoadOptions  # noqa: E402

#: A finite language (enum, boolean, bounded integer): even random weights must close it within max_tokens.
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "color", "n"], "additionalProperties": False}
GRAMMAR = ["json_schema", json.dumps(SCHEMA)]
PROMPTS = ["Hello", "The capital", "def add", "Numbers: 0 1", "M* serves", "The quick brown"]


async def _run(engine, tok, prompt, grammar=None, **extra):
    inputs = {"prompt": prompt, "max_tokens": 40, "temperature": 0, **extra}
    if grammar is not None:
        inputs["grammar"] = grammar
    handle = await engine.submit_async("llama", inputs)
    tokens: list = []
    async for out in handle:
        if out.name == "next_token":
            tokens.append((out.branch, int(out.value)))
    env = await handle.result()
    return tokens, env.get("finish_reason")


def _text(tok, tokens):
    return tok.decode([t for _, t in tokens], skip_special_tokens=True)


def test_mixed_batch_constrained_rows_validate_and_free_rows_match_alone(tiny):
    from mstar_core.runtime import AsyncEngine

    async def main():
        async with AsyncEngine() as engine:
            await engine.load_model("llama", LoadOptions(preset="tiny"))
            tok = tiny.extras["tokenizer"]
            alone = [await _run(engine, tok, p, temperature=0.8, seed=i) for i, p in enumerate(PROMPTS)]
            mixed = await asyncio.gather(*(
                _run(engine, tok, p, GRAMMAR if i % 2 else None, **({} if i % 2 else {"temperature": 0.8, "seed": i}))
                for i, p in enumerate(PROMPTS)))
            return alone, mixed

    alone, mixed = asyncio.run(main())
    tok = tiny.extras["tokenizer"]
    for i, (tokens, reason) in enumerate(mixed):
        if i % 2:
            assert reason == "stop", (i, _text(tok, tokens))
            jsonschema.validate(json.loads(_text(tok, tokens)), SCHEMA)
        else:
            assert tokens == alone[i][0], i  # a free row draws what it draws alone, grammars beside it or not


def test_forks_and_json_object(tiny):
    from mstar_core.runtime import AsyncEngine

    async def main():
        async with AsyncEngine() as engine:
            await engine.load_model("llama", LoadOptions(preset="tiny"))
            tok = tiny.extras["tokenizer"]
            forks = await _run(engine, tok, "Hello there", GRAMMAR, n=3, temperature=1.0, seed=5)
            obj = await _run(engine, tok, "Hello", ["json_object", ""], max_tokens=300)
            return forks, obj

    (forks, _), (obj, reason) = asyncio.run(main())
    tok = tiny.extras["tokenizer"]
    for branch in range(3):
        text = tok.decode([t for b, t in forks if b == branch], skip_special_tokens=True)
        jsonschema.validate(json.loads(text), SCHEMA)  # each fork's matcher is its own
    text = _text(tok, obj)
    if reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # a grammar that cannot finish within max_tokens ends with length, as unconstrained text does
        assert reason == "length" and text.startswith("{")


def test_row_grammar_forks_and_replays():
    """A matcher is the label's: a clone advances apart from its parent; replaying generated tokens rebuilds it."""
    from mstar_kvcache.grammar import grammar_for

    from mstar_core.grammar import GrammarSpec, GrammarVocab

    pieces = tuple([b"", b"{", b"}", b'"a"', b":", b"1", b"2", b" "])
    vocab = GrammarVocab(pieces, (0,), len(pieces))
    spec = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                  "required": ["a"], "additionalProperties": False}))
    row = grammar_for("lm", vocab, spec, [1, 3, 4, 7])  # {"a": (the fixed separators put a space after the colon)
    fork = row.fork()
    assert row.matcher.accept_token(5) and fork.matcher.accept_token(6)
    again = grammar_for("lm", vocab, spec, [1, 3, 4, 7, 5])  # a moved label replays what it generated
    assert again.matcher.accept_token(2) and row.matcher.accept_token(2)
    assert again.matcher.accept_token(0) and again.finished


def test_bad_schemas_are_400s_naming_the_path():
    from mstar_core.errors import RequestError
    from mstar_core.grammar.check import check_json_schema

    with pytest.raises(RequestError, match=r"schema\.properties\.age.*not a valid JSON schema"):
        check_json_schema({"type": "object", "properties": {"age": {"type": "integr"}}}, "schema")
    with pytest.raises(RequestError, match=r"'schema\.properties\.tags' uses uniqueItems"):
        check_json_schema({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}, "schema")
    with pytest.raises(RequestError, match=r"only references inside the schema"):
        check_json_schema({"$ref": "https://example.com/s.json"}, "schema")


def test_grammar_rows_survive_preemption(tiny):
    """A pool too small for every row at once preempts some (their keys and values are recomputed later): the
    grammar state stays with the label's tokens, so every output still validates."""
    from mstar_core.runtime import AsyncEngine

    async def main():
        async with AsyncEngine() as engine:
            await engine.load_model("llama", LoadOptions(preset="tiny"), settings={"lm": {"num_pages": 10}})
            tok = tiny.extras["tokenizer"]
            outs = await asyncio.gather(*(_run(engine, tok, p * 3, GRAMMAR, temperature=0.9, seed=i)
                                          for i, p in enumerate(PROMPTS)))
            preempted = sum(g.get("num_preemptions", 0) for node, _w, g in engine.node_stats("llama") if node == "lm")
            return outs, preempted

    outs, preempted = asyncio.run(main())
    assert preempted > 0  # (else the test shows nothing: shrink num_pages)
    tok = tiny.extras["tokenizer"]
    for tokens, reason in outs:
        assert reason == "stop"
        jsonschema.validate(json.loads(_text(tok, tokens)), SCHEMA)
