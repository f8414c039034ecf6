"""Served Qwen3-Omni on the shared engines: greedy text and speech equal transformers' generate(return_audio=True)."""

import asyncio
import json
from pathlib import Path

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


def hf_speech(hf, ids, thinker_max, talker_max, penalty, monkeypatch):
    """transformers' reply tokens and codes `[G, frames]` (caught on their way into its Code2Wav)."""
    seen = []
    decode = hf.code2wav.chunked_decode
    monkeypatch.setattr(hf.code2wav, "chunked_decode", lambda c, **kw: seen.append(c) or decode(c, **kw))
    im_end = json.loads((Path(hf.name_or_path) / "config.json").read_text())["im_end_token_id"]
    with torch.no_grad():
        seqs, _ = hf.generate(torch.tensor([ids]), speaker="ethan", return_audio=True,
                              thinker_max_new_tokens=thinker_max, thinker_eos_token_id=im_end,
                              thinker_do_sample=False, talker_do_sample=False, talker_repetition_penalty=penalty,
                              talker_max_new_tokens=talker_max)
    monkeypatch.setattr(hf.code2wav, "chunked_decode", decode)
    return seqs[0, len(ids):].tolist(), seen[0][0]


def test_served_speech_equals_transformers_generate(hf, tokenizer, monkeypatch):
    ids = chat_ids(tokenizer, "Hello! What is in this picture?")
    thinker_max, talker_max = 5, 36
    speech_inputs = {"prompt_ids": ids, "speaker": "ethan", "max_tokens": thinker_max,
                     "talker_max_tokens": talker_max, "talker_temperature": 0.0}

    async def main():
        async with AsyncEngine(discover()) as engine:
            await engine.load_model("qwen3-omni", LoadOptions(preset="tiny"))
            return await asyncio.gather(
                run(engine, {**speech_inputs, "talker_repetition_penalty": 1.0}),
                # a strong penalty on code 0 changes the speech: the penalty must count
                # exactly the codes spoken, as transformers' does
                run(engine, {**speech_inputs, "talker_repetition_penalty": 3.0}),
                run(engine, {"prompt_ids": ids, "max_tokens": thinker_max}))

    plain, penalised, text = asyncio.run(main())
    for got, penalty in ((plain, 1.0), (penalised, 3.0)):
        reply, hf_codes = hf_speech(hf, ids, thinker_max, talker_max, penalty, monkeypatch)
        assert got["next_token"] == reply and text["next_token"] == reply
        codes = torch.stack([c for c in got["codes"] if c is not None], dim=1)
        assert torch.equal(codes, hf_codes), penalty
        wav = torch.cat(got["audio"])
        ref = hf.code2wav.chunked_decode(codes[None], chunk_size=25, left_context_size=25)[0, 0]
        assert wav.shape == ref.shape and (wav - ref).abs().max() < 1e-4
        assert len(got["audio"]) == -(-codes.shape[1] // 25)  # one chunk per 25 frames, the tail flushed
    # the penalty changes the speech (and both equal transformers' above); the preset's Talker rarely ends by EOS
    assert [c.tolist() for c in penalised["codes"]] != [c.tolist() for c in plain["codes"]]
    assert not text["codes"] and not text["audio"]  # the text-only plan never touched the Talker
