"""The tiny Llama's vocabulary is padded past its tokenizer (448 rows for 431 tokens, as real checkpoints pad):
the padded ids are the vocabulary's `no_token_ids`, and the engine never samples one, so every reply decodes."""

from __future__ import annotations

import pytest

from mstar_core.model import LoadOptions


def test_padded_rows_are_no_token_ids(tiny):
    vocab, tokenizer = tiny.extras["grammar_vocab"], tiny.extras["tokenizer"]
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    assert vocab.vocab_size == tiny.extras["config"].vocab_size > size  # the preset pads, or this tests nothing
    assert vocab.no_token_ids == tuple(range(size, vocab.vocab_size))


@pytest.mark.parametrize("temperature", [0.0, 1.0, 2.0])
async def test_sampled_ids_always_have_a_token(tiny, preset_cache, temperature):
    from mstar_core.runtime import AsyncEngine

    size = tiny.extras["tokenizer"].get_vocab_size(with_added_tokens=True)
    engine = AsyncEngine()
    try:
        await engine.load_model("llama", LoadOptions(preset="tiny"), settings={"lm": {"num_pages": 128}})
        handles = [engine.submit("llama", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 48,
                                           "temperature": temperature, "seed": seed, "ignore_eos": True})
                   for seed in range(4)]
        for handle in handles:
            tokens = [int(o.value) async for o in handle if o.name == "next_token"]
            assert len(tokens) == 48 and max(tokens) < size, tokens
    finally:
        await engine.close()
