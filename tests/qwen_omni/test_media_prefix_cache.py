"""A text reply's turn 2 after an audio turn reuses turn 1's KV (audio rows included): only its new tokens are computed,
and its greedy reply equals the same request on a Thinker without a prefix cache."""

import asyncio

import attrs
import numpy as np
import torch

from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.runtime import AsyncEngine

WAVE = np.random.default_rng(5).standard_normal(16000).astype(np.float32) * 0.1  # 1 s at 16 kHz
REPLY = 3
PAGE = 16  # the kvcache engine's default page size


def turns(reply=None):
    out = [{"role": "system", "content": "You are Qwen, a virtual human."},
           {"role": "user", "content": [{"type": "audio", "audio": torch.from_numpy(WAVE)},
                                        {"type": "text", "text": "What is this?"}]}]
    if reply is not None:
        out += [{"role": "assistant", "content": [{"type": "tokens", "ids": reply}]},
                {"role": "user", "content": "And then?"}]
    return out


async def reply(engine, model, messages):
    handle = engine.submit(model, {"messages": messages, "max_tokens": REPLY})
    tokens = [int(out.value) async for out in handle if out.name == "next_token"]
    await handle.result()
    return tokens


def test_turn_two_after_an_audio_turn_computes_only_its_new_tokens():
    async def main():
        async with AsyncEngine(discover()) as engine:
            loaded = await engine.load_model("qwen3-omni", LoadOptions(preset="tiny"))
            await engine.add_model(attrs.evolve(loaded), settings={"thinker": {"enable_prefix_caching": False}},
                                   alias="cold")
            thinker = engine.node_engines("qwen3-omni")["thinker"]
            first = await reply(engine, "qwen3-omni", turns())
            before = thinker.tokens_forwarded
            second = await reply(engine, "qwen3-omni", turns(first))
            forwarded = thinker.tokens_forwarded - before
            return loaded, first, second, forwarded, await reply(engine, "cold", turns(first))

    loaded, first, second, forwarded, reference = asyncio.run(main())
    one, two = len(loaded.prepare.build(turns()).ids), len(loaded.prepare.build(turns(first)).ids)
    kept = one + REPLY - 1  # turn 1's prompt and fed-back reply (its last sampled token never went in)
    prefill = forwarded - (REPLY - 1)  # turn 2's decode steps compute one row each
    assert two - kept <= prefill <= two - kept + PAGE - 1, (one, two, forwarded)  # at most turn 1's partial page
    assert prefill < two - 2 * PAGE  # the audio's rows came from the cache
    assert second == reference  # the cached rows are the ones a cold prefill computes
