"""`max_tokens` past the context is capped up front (OpenAI's behaviour): the reply stops with finish_reason "length"
at the context's end, on the native walk and the OpenAI routes alike, instead of generating there and then failing."""

from __future__ import annotations

import asyncio

from mstar_core.model import LoadOptions
from mstar_core.runtime import AsyncEngine


def test_prepare_caps_max_tokens_to_the_room_left(tiny):
    limit = tiny.extras["max_model_len"]
    env = tiny.prepare_inputs({"input_ids": [5, 6, 7], "max_tokens": 1_000_000})
    assert env["sampling"].max_tokens == limit - 3
    assert tiny.prepare_inputs({"input_ids": [5, 6, 7], "max_tokens": 9})["sampling"].max_tokens == 9
    ids = [5] * (limit - 10)
    assert tiny.prepare_inputs({"input_ids": ids})["sampling"].max_tokens == 10  # the default (256) is capped too


def test_a_request_past_the_context_ends_with_length_not_an_error(tiny):
    limit = tiny.extras["max_model_len"]
    ids = [5 + i % 50 for i in range(limit - 6)]

    async def run():
        async with AsyncEngine() as engine:
            await engine.load_model("llama", LoadOptions(preset="tiny"))
            handle = engine.submit("llama", {"input_ids": ids, "max_tokens": 1_000_000, "ignore_eos": True})
            tokens = []
            async for out in handle:
                if out.name == "next_token":
                    tokens.append(out.value)
            return tokens, await handle.result()

    tokens, env = asyncio.run(run())
    assert env["finish_reason"] == "length"
    assert len(tokens) == 6
