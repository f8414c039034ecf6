"""Speculative decoding on the Qwen3-Omni Thinker (M-RoPE positions, hidden states read by the Talker): the reply
and the speech made from it are those of plain decoding."""

import pytest

from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.runtime import AsyncEngine

NGRAM = {"method": "ngram", "num_tokens": 4, "max_ngram": 3, "min_ngram": 1}
TEXT = "one two three four five six seven eight, one two three four five six seven eight, one two three"
SPEECH = {"messages": [{"role": "user", "content": TEXT}], "speaker": "chelsie", "talker_temperature": 0.0,
          "talker_repetition_penalty": 1.0, "max_tokens": 20, "talker_max_tokens": 8, "ignore_eos": True}


async def _reply(settings: dict) -> tuple[list[int], list, dict]:
    engine = AsyncEngine(discover())
    try:
        await engine.load_model("qwen3-omni", LoadOptions(preset="tiny"), settings=settings)
        handle = engine.submit("qwen3-omni", SPEECH)
        tokens, codes = [], []
        async for out in handle:
            if out.name == "next_token":
                tokens.append(int(out.value))
            elif out.name == "codes" and out.value is not None:
                codes.append(out.value.tolist())
        return tokens, codes, engine.node_engines("qwen3-omni")["thinker"].stats()
    finally:
        await engine.close()


@pytest.mark.slow  # (two loads of the preset: ~40 s on the loaded 2-core box)
async def test_the_thinker_speculates_and_the_reply_and_speech_are_unchanged():
    want_tokens, want_codes, _ = await _reply({})
    tokens, codes, stats = await _reply({"thinker": {"speculative": NGRAM}})
    assert tokens == want_tokens and len(tokens) == 20
    assert codes == want_codes and codes  # the Talker read the same Thinker states
    assert stats["spec_accepted_tokens"] > 0 and stats["kv_pages_used"] == 0
