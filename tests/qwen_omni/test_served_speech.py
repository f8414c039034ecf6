"""Served Qwen3-Omni on the shared engines: greedy text and speech equal transformers' generate(return_audio=True)."""

import asyncio

import pytest
import torch

from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.runtime import AsyncEngine
from tests.qwen_omni.test_reference_speech import chat_ids

GREEDY = {"talker_temperature": 0.0, "talker_repetition_penalty": 1.0}


async def run(engine, inputs):
    handle = engine.submit("qwen3-omni", inputs)
    outs = {"next_token": [], "codes": [], "audio": []}
    async for out in handle:
        if out.name in outs:
            outs[out.name].append(out.value)
    await handle.result()
    return outs


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from mstar_core.checkpoint import load_tokenizer

    return load_tokenizer(tiny_dir)


def test_served_speech_equals_transformers_generate(omni, hf, tokenizer, monkeypatch):
    cfg = omni.config
    ids = chat_ids(tokenizer, "Hello! What is in this picture?")
    thinker_max, talker_max = 5, 36

    async def main():
        async with AsyncEngine(discover()) as engine:
            await engine.load_model("qwen3-omni", LoadOptions(preset="tiny"))
            speech, text = await asyncio.gather(
                run(engine, {"prompt_ids": ids, "speaker": "ethan", "max_tokens": thinker_max,
                             "talker_max_tokens": talker_max, **GREEDY}),
                run(engine, {"prompt_ids": ids, "max_tokens": thinker_max}))
            return speech, text

    speech, text = asyncio.run(main())
    seen = []
    decode = hf.code2wav.chunked_decode
    monkeypatch.setattr(hf.code2wav, "chunked_decode", lambda c, **kw: seen.append(c) or decode(c, **kw))
    with torch.no_grad():
        seqs, _ = hf.generate(torch.tensor([ids]), speaker="ethan", return_audio=True,
                              thinker_max_new_tokens=thinker_max, thinker_eos_token_id=cfg.im_end_token_id,
                              thinker_do_sample=False, talker_do_sample=False, talker_repetition_penalty=1.0,
                              talker_max_new_tokens=talker_max)
    reply = seqs[0, len(ids):].tolist()
    assert speech["next_token"] == reply and text["next_token"] == reply
    assert not text["codes"] and not text["audio"]  # the text-only plan never touched the Talker
    codes = torch.stack([c for c in speech["codes"] if c is not None], dim=1)
    assert torch.equal(codes, seen[0][0])
    wav = torch.cat(speech["audio"])
    ref = hf.code2wav.chunked_decode(codes[None], chunk_size=25, left_context_size=25)[0, 0]
    assert wav.shape == ref.shape and (wav - ref).abs().max() < 1e-4
    assert len(speech["audio"]) == -(-codes.shape[1] // 25)  # one chunk per 25 frames, the tail flushed
