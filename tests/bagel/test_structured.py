"""BAGEL's understanding decodes under a grammar (tiny preset, random weights, so only what the grammar enforces is
asserted): the prompt writes sample no token the grammar sees, a constrained reply validates, and free rows batched
beside constrained ones draw exactly what they draw alone."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from mstar_core.model import LoadOptions
from mstar_core.runtime import AsyncEngine

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

#: A finite language (boolean, enum, bounded integer): even random weights close it within max_tokens.
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "color", "n"], "additionalProperties": False}
GRAMMAR = ["json_schema", json.dumps(SCHEMA)]


def _image(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (30, 44, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


#: Understand requests of several parts each (every part a prompt write before the reply).
CONTENTS = [["first", _image(0), "what is it?"], ["JSON please."], [_image(1), "colour?", "and a number"],
            ["a", "b", "c", "d"]]


async def _run(engine, content, grammar=None, **extra):
    inputs = {"task": "understand", "content": content, "max_tokens": 48, **extra}
    if grammar is not None:
        inputs["grammar"] = grammar
    handle = await engine.submit_async("bagel", inputs)
    tokens = [int(o.value) async for o in handle if o.name == "next_token"]
    return tokens, (await handle.result())["finish_reason"]


def test_mixed_batch_constrained_rows_validate_and_free_rows_match_alone(monkeypatch):
    import mstar_kvcache.grammar as row_grammars

    shared = []  # sampling steps whose batch held both a free row and a constrained one
    apply_masks = row_grammars.apply_masks

    def spy(logits, grammars):
        if any(g is None for g in grammars) and any(g is not None for g in grammars):
            shared.append(len(grammars))
        return apply_masks(logits, grammars)

    monkeypatch.setattr(row_grammars, "apply_masks", spy)

    async def main():
        async with AsyncEngine() as engine:
            loaded = await engine.load_model("bagel", LoadOptions(preset="tiny"))
            free = {i: {"temperature": 0.8, "seed": i, "max_tokens": 16} for i in range(0, len(CONTENTS), 2)}
            alone = {i: await _run(engine, CONTENTS[i], **kw) for i, kw in free.items()}
            mixed = await asyncio.gather(*(
                _run(engine, c, **free[i]) if i in free else _run(engine, c, GRAMMAR, temperature=0.9, seed=7 + i)
                for i, c in enumerate(CONTENTS)))
            return loaded, free, alone, mixed, engine.node_engines("bagel")["llm"].pool.num_used

    loaded, free, alone, mixed, pages_left = asyncio.run(main())
    assert pages_left == 0 and shared  # (else the rows never met in one batch and the test shows nothing)
    tok = loaded.extras["tokenizer"]
    for i, (tokens, reason) in enumerate(mixed):
        if i not in free:
            text = tok.decode(tokens, skip_special_tokens=True)
            assert reason == "stop" and tokens[-1] == loaded.extras["special_ids"].eos, (i, text)
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert (tokens, reason) == alone[i], i  # a free row draws what it draws alone, grammars beside it or not


def test_max_tokens_counts_the_reply_alone_and_images_refuse_a_grammar():
    async def main():
        async with AsyncEngine() as engine:
            await engine.load_model("bagel", LoadOptions(preset="tiny"))
            # <|im_end|> pushed away: the reply runs to max_tokens, however many parts were written before it
            long = await _run(engine, CONTENTS[3], max_tokens=5, logit_bias={"258": -100})
            with pytest.raises(Exception, match="'grammar' constrains text"):
                engine.submit("bagel", {"task": "t2i", "prompt": "a fox", "grammar": GRAMMAR})
            return long

    tokens, reason = asyncio.run(main())
    assert len(tokens) == 5 and reason == "length"
