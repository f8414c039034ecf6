"""Cloning with the reference audio's transcript (Base, in-context mode): the served speech for a voice with
reference codes and transcript has the codes of the `qwen-tts` package's greedy `generate` with the same voice
clone prompt (`icl_mode`, `ref_code`, `ref_ids`), streaming text (its default for clones) and not, with the
transcript + text shorter and longer than the reference codes; and its audio is the package's (the reference codes
and the new ones decoded together, the reference's share cut off) to `WAVE_TOL`: the random decoder saturates, and
float rounding moves a few samples by up to ~7e-4 (mean ~2e-6)."""

import asyncio

import pytest
import torch
from mstar_qwen_tts.prepare import assistant_text, reference_text

from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.runtime import AsyncEngine
from tests.qwen_tts.oracle import load_reference

FRAMES = 12
#: the waveform tolerance of the package comparisons (`test_fidelity.WAVE_TOL`)
WAVE_TOL = 2e-3


@pytest.fixture(scope="module")
def base_dir(preset_cache):
    from mstar_qwen_tts.preset import ensure_tiny

    return ensure_tiny("tiny-base")


@pytest.fixture(scope="module")
def reference(base_dir):
    return load_reference(base_dir)


def _voice(samples: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(samples)
    t = torch.arange(samples) / 24000
    return (0.3 * torch.sin(2 * torch.pi * 180 * t) + 0.05 * torch.randn(samples, generator=g)).clamp(-1, 1)


def _served(requests: list[dict], audio: list | None = None) -> list[torch.Tensor]:
    async def one(engine, inputs):
        handle = engine.submit("qwen3-tts", {**inputs, "do_sample": False, "subtalker_dosample": False,
                                             "max_frames": FRAMES})
        outs = [o async for o in handle]
        await handle.result()
        if audio is not None:
            audio.append(torch.cat([o.value for o in outs if o.name == "audio"]))
        return torch.stack([o.value for o in outs if o.name == "codes" and o.value is not None])

    async def main():
        async with AsyncEngine(discover()) as engine:
            await engine.load_model("qwen3-tts", LoadOptions(preset="tiny-base"))
            return await asyncio.gather(*(one(engine, r) for r in requests))

    return asyncio.run(main())


# (reference samples, transcript, text, non-streaming): 19 reference frames outnumber the short texts' tokens; 4
# frames are fewer than the long ones' (their text rows trail into the decode steps)
CASES = [
    (36000, "Hi.", "Hello there!", False),
    (8000, "The quick brown fox jumps over the lazy dog.", "A warm, low voice that speaks slowly and clearly.", False),
    (8000, "The quick brown fox.", "Hello there, the lazy dog sings!", True),
]


@pytest.mark.slow
def test_served_icl_codes_equal_qwen_tts_generate(base_dir, reference, tokenizer):
    from mstar_qwen_tts.checkpoint import load_speech_encoder, load_tts

    from tests.qwen_tts.oracle import load_reference_decoder

    model = load_tts(base_dir, progress=False)
    encoder = load_speech_encoder(base_dir, progress=False)
    prompts = []
    for samples, transcript, text, non_streaming in CASES:
        wav = _voice(samples)
        prompts.append((model.speaker_encoder.embed(wav), encoder.encode(wav), transcript, text, non_streaming))
    audio: list[torch.Tensor] = []
    got = _served([{"input": text, "speaker_embedding": emb.tolist(), "ref_codes": codes.flatten().tolist(),
                    "ref_text": transcript, "non_streaming_mode": non_streaming}
                   for emb, codes, transcript, text, non_streaming in prompts], audio)
    decoder = load_reference_decoder(base_dir)
    for (emb, codes, transcript, text, non_streaming), ours, wav in zip(prompts, got, audio, strict=True):
        ids = tokenizer.encode(assistant_text(text), add_special_tokens=False).ids
        ref_ids = tokenizer.encode(reference_text(transcript), add_special_tokens=False).ids
        with torch.no_grad():
            want, _ = reference.generate(
                input_ids=[torch.tensor([ids])], ref_ids=[torch.tensor([ref_ids])], languages=["auto"],
                speakers=[None], non_streaming_mode=non_streaming,
                voice_clone_prompt={"ref_spk_embedding": [emb], "x_vector_only_mode": [False], "icl_mode": [True],
                                    "ref_code": [codes]},
                max_new_tokens=FRAMES, do_sample=False, subtalker_dosample=False)
        assert 1 <= ours.shape[0] <= FRAMES - 1 and torch.equal(ours, want[0]), (transcript, text, non_streaming)
        # the package's audio: reference and new codes decoded together, the reference's share cut off
        with torch.no_grad():
            full = decoder.chunked_decode(torch.cat([codes, want[0]]).t()[None]).clamp(-1, 1)[0, 0]
        expected = full[codes.shape[0] * 1920:]
        assert wav.shape == expected.shape and (wav - expected).abs().max() < WAVE_TOL
        # (decoded without the reference before them, the same codes sound different: the context matters)
        alone = decoder.chunked_decode(want[0].t()[None]).clamp(-1, 1)[0, 0]
        assert (alone - expected).abs().max() > 0.1
    # the in-context prompt shapes the speech: the same voice without it (x-vector only) speaks other codes
    emb, codes, transcript, text, non_streaming = prompts[0]
    (x_vector_only,) = _served([{"input": text, "speaker_embedding": emb.tolist(), "non_streaming_mode": False}])
    assert not torch.equal(x_vector_only, got[0])


class _Captured(Exception):
    pass


@pytest.mark.parametrize("case", range(len(CASES)))
def test_icl_prompt_rows_equal_qwen_tts(base_dir, reference, tokenizer, case):
    """The Talker's prefill rows and the decode steps' text rows equal those the package's `generate` hands its
    Talker (captured at `talker.generate`, before any step runs)."""
    from mstar_qwen_tts.checkpoint import load_speech_encoder, load_tts
    from mstar_qwen_tts.prompt import talker_rows

    samples, transcript, text, non_streaming = CASES[case]
    model = load_tts(base_dir, progress=False)
    wav = _voice(samples)
    emb, codes = model.speaker_encoder.embed(wav), load_speech_encoder(base_dir, progress=False).encode(wav)
    ids = tokenizer.encode(assistant_text(text), add_special_tokens=False).ids
    ref_ids = tokenizer.encode(reference_text(transcript), add_special_tokens=False).ids
    seen = {}

    def capture(**kwargs):
        seen.update(kwargs)
        raise _Captured

    reference.talker.generate = capture
    try:
        with pytest.raises(_Captured), torch.no_grad():
            reference.generate(
                input_ids=[torch.tensor([ids])], ref_ids=[torch.tensor([ref_ids])], languages=["auto"],
                speakers=[None], non_streaming_mode=non_streaming,
                voice_clone_prompt={"ref_spk_embedding": [emb], "x_vector_only_mode": [False], "icl_mode": [True],
                                    "ref_code": [codes]}, max_new_tokens=4, do_sample=False)
    finally:
        del reference.talker.generate
    prefill, trailing = talker_rows(model.talker, model.config, ids, [], "", "auto", non_streaming, emb,
                                    ref_ids[3:-2], codes)
    assert torch.equal(prefill, seen["inputs_embeds"][0])
    want = seen["trailing_text_hidden"][0]
    # upstream feeds `tts_pad` once its trailing rows run out (or has that one row when there are none); ours end
    # with the `tts_pad` row that repeats
    assert torch.equal(trailing[-1], seen["tts_pad_embed"].view(-1))
    assert torch.equal(trailing[:-1] if trailing.shape[0] > 1 else trailing, want)
    assert (trailing.shape[0] > 1) == (case == 1)  # only the long text outgrows the reference codes, streaming
