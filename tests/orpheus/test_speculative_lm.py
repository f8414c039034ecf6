"""Speculative decoding configured on Orpheus' LM: greedy speech tokens identical to plain decoding, every page
freed. (The tiny preset's frames never repeat a token n-gram, so prompt lookup finds no guess here: this shows the
setting is harmless on a speech LM; guesses under Orpheus' repetition penalty are verified in
tests/engines/test_kvcache_speculative.py.)"""

import pytest

from mstar_core.model import LoadOptions
from mstar_core.runtime import AsyncEngine
from tests.orpheus.helpers import collect

NGRAM = {"method": "ngram", "num_tokens": 4, "max_ngram": 3, "min_ngram": 1}


async def _tokens(settings: dict) -> tuple[list, dict]:
    engine = AsyncEngine()
    try:
        await engine.load_model("orpheus", LoadOptions(preset="tiny"), settings={"lm": {"num_pages": 64, **settings}})
        _, tokens, _ = await collect(engine.submit("orpheus", {"text": "Hello there, hello there.", "voice": "tara",
                                                              "max_tokens": 48, "temperature": 0.0}))
        return tokens, engine.node_engines("orpheus")["lm"].stats()
    finally:
        await engine.close()


@pytest.mark.slow  # (two loads of the preset)
async def test_orpheus_greedy_speech_tokens_are_identical_with_speculation(preset_cache):
    want, _ = await _tokens({})
    got, stats = await _tokens({"speculative": NGRAM})
    assert got == want and len(got) > 0
    assert "spec_proposed_tokens" in stats and stats["kv_pages_used"] == 0
