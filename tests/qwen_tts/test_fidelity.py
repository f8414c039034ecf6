"""Served Qwen3-TTS (tiny preset, the shared kvcache and stateless engines) against the `qwen-tts` package's own
greedy `generate(do_sample=False, subtalker_dosample=False)` on the same files: identical codes for a preset speaker
(both text-feeding modes, a language and a dialect speaker) and for voice design; the speech decoder equals the
upstream decoder's offline `chunked_decode` (300 / 25) to 2e-3, and the streamed 25/25 windows equal M*'s own
`chunked_decode(25, 25)` to 2e-3 (windows of concurrent requests are decoded as one batch: batched convolutions round
differently). The tolerance is the tiny random vocoder's: its four random SnakeBeta upsampling blocks at the real
1,920 samples a frame amplify float rounding to ~9e-4 on samples clamped to +-1 (4e-5 with the 8-sample decoder
preset 1 had). (Streamed audio differs from the upstream offline decode by design: each 25-frame
window sees 25 frames of context, not 300; that difference is measured, not hidden, in the last test.)
"""

import asyncio

import pytest
import torch
from mstar_qwen_tts.prepare import assistant_text, instruct_text

from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.runtime import AsyncEngine
from tests.qwen_tts.oracle import load_reference, load_reference_decoder, reference_codes

FRAMES = 30
GREEDY = {"do_sample": False, "subtalker_dosample": False, "max_frames": FRAMES}
#: the first code 0 greedy picks on the tiny preset for the "speaker" case
FIRST_CODE = 1512
CASES = {
    "speaker": ({"input": "Hello there!", "voice": "ryan"}, {"speaker": "ryan"}),
    "speaker-streaming-text": ({"input": "Hello there! The quick brown fox.", "voice": "ryan",
                                "non_streaming_mode": False, "language": "english"},
                               {"speaker": "ryan", "non_streaming": False, "language": "english"}),
    "dialect-speaker": ({"input": "A warm voice.", "voice": "eric"}, {"speaker": "eric"}),
    "speaker-with-style": ({"input": "Hello there!", "voice": "eric", "instructions": "Speak slowly."},
                           {"speaker": "eric", "instruct": "Speak slowly."}),
}
#: voice design: the same weights as a VoiceDesign checkpoint (preset `tiny-design`), no speaker slot
DESIGN = ({"input": "Hello there!", "instructions": "A warm, low voice that speaks slowly."},
          {"instruct": "A warm, low voice that speaks slowly."})

#: the waveform tolerance stated above (the codes are compared exactly)
WAVE_TOL = 2e-3


async def _run(engine, inputs):
    handle = engine.submit("qwen3-tts", inputs)
    outs = {"codes": [], "audio": []}
    async for out in handle:
        if out.name in outs:
            outs[out.name].append(out.value)
    await handle.result()
    return outs


@pytest.fixture(scope="module")
def served(tiny_dir):
    async def main():
        async with AsyncEngine(discover()) as engine:
            await engine.load_model("qwen3-tts", LoadOptions(preset="tiny"))
            # concurrent: the frames of every request share the Talker's and the predictor's batches
            results = await asyncio.gather(*(_run(engine, {**GREEDY, **inputs}) for inputs, _ in CASES.values()))
        async with AsyncEngine(discover()) as engine:
            await engine.load_model("qwen3-tts", LoadOptions(preset="tiny-design"))
            design = await _run(engine, {**GREEDY, **DESIGN[0]})
        return {**dict(zip(CASES, results, strict=True)), "design": design}

    return asyncio.run(main())


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return load_reference(tiny_dir)


@pytest.fixture(scope="module")
def design_reference(preset_cache):
    from mstar_qwen_tts.preset import ensure_tiny

    return load_reference(ensure_tiny("tiny-design"))


@pytest.mark.slow
@pytest.mark.parametrize("case", [*CASES, "design"])
def test_served_codes_equal_qwen_tts_generate(served, reference, design_reference, tokenizer, case):
    inputs, ref_args = CASES.get(case, DESIGN)
    ref_args = dict(ref_args)
    reference = design_reference if case == "design" else reference
    ids = tokenizer.encode(assistant_text(inputs["input"]), add_special_tokens=False).ids
    instruct = ref_args.pop("instruct", None)
    instruct_ids = tokenizer.encode(instruct_text(instruct), add_special_tokens=False).ids if instruct else None
    want = reference_codes(reference, ids, instruct_ids=instruct_ids, max_frames=FRAMES, **ref_args)
    got = torch.stack([c for c in served[case]["codes"] if c is not None])
    assert want.shape[1] == 4 and 1 <= want.shape[0] <= FRAMES - 1  # ended by EOS (v4 presets) or at max_frames
    assert torch.equal(got, want)


@pytest.mark.slow
def test_cases_differ(served):
    # the speaker slot, the language and the instruct turn each change the speech (none of them is dropped)
    firsts = {case: torch.stack([c for c in out["codes"] if c is not None]) for case, out in served.items()}
    codes = list(firsts.values())
    assert all(not torch.equal(a, b) for i, a in enumerate(codes) for b in codes[i + 1:])


@pytest.mark.slow
def test_streamed_audio_is_the_decoders_25_frame_windows(served, tiny_dir):
    from mstar_qwen_tts.checkpoint import load_speech_decoder

    decoder = load_speech_decoder(tiny_dir, progress=False)
    for out in served.values():
        codes = torch.stack([c for c in out["codes"] if c is not None], dim=1)[None]  # [1, G, frames]
        with torch.inference_mode():
            want = decoder.chunked_decode(codes, 25, 25)[0, 0]
        wav = torch.cat(out["audio"])
        assert len(out["audio"]) == -(-codes.shape[-1] // 25)  # one chunk per 25 frames, the tail flushed
        assert wav.shape == want.shape and (wav - want).abs().max() < WAVE_TOL


def test_speech_decoder_equals_upstream_decode(tiny_dir):
    from mstar_qwen_tts.checkpoint import load_speech_decoder

    ref = load_reference_decoder(tiny_dir)
    ours = load_speech_decoder(tiny_dir, progress=False)
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 2048, (2, 4, 40), generator=g)
    with torch.inference_mode():
        want = ref.chunked_decode(codes, chunk_size=300, left_context_size=25)
        got = ours.chunked_decode(codes, 300, 25)
        assert got.shape == want.shape == (2, 1, 40 * 1920)
        assert (got - want).abs().max() < WAVE_TOL
        # the 25/25 windows M* streams, against the upstream decoder run the same way: same numbers
        want25 = ref.chunked_decode(codes, chunk_size=25, left_context_size=25)
        assert (ours.chunked_decode(codes, 25, 25) - want25).abs().max() < WAVE_TOL


@pytest.mark.slow
def test_an_early_eos_ends_both_alike_after_the_first_two_codes(tiny_dir, tmp_path, tokenizer):
    """EOS made likely (its head row twice the row of the code greedy picks first): the upstream `min_new_tokens`
    (2) keeps the first two codes 0 from being EOS, and M* ends where the package does."""
    import shutil

    from safetensors.torch import load_file, save_file

    directory = tmp_path / "eager-eos"
    shutil.copytree(tiny_dir, directory)
    weights = load_file(directory / "model.safetensors")
    head = weights["talker.codec_head.weight"]
    head[2150] = 2.0 * head[FIRST_CODE]
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    inputs, ref_args = CASES["speaker"]

    async def main():
        async with AsyncEngine(discover()) as engine:
            await engine.load_model("qwen3-tts", LoadOptions(checkpoint=str(directory)))
            return await _run(engine, {**GREEDY, **inputs})

    got = asyncio.run(main())["codes"]
    frames = [c for c in got if c is not None]
    ids = tokenizer.encode(assistant_text(inputs["input"]), add_special_tokens=False).ids
    want = reference_codes(load_reference(directory), ids, max_frames=FRAMES, **ref_args)
    assert 2 <= want.shape[0] < FRAMES - 1, want.shape  # EOS ended it early, never before two frames
    assert torch.equal(torch.stack(frames), want)
