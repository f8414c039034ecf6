"""Cloning (Base, x-vector mode): the speaker encoder equals the `qwen-tts` package's (log-mel and x-vector), and the
served speech for a cloned voice has the codes of the package's greedy `generate` with that voice clone prompt."""

import asyncio

import pytest
import torch
from mstar_qwen_tts.prepare import assistant_text

from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.runtime import AsyncEngine
from tests.qwen_tts.oracle import load_reference

FRAMES = 20


@pytest.fixture(scope="module")
def base_dir(preset_cache):
    from mstar_qwen_tts.preset import ensure_tiny

    return ensure_tiny("tiny-base")


@pytest.fixture(scope="module")
def reference(base_dir):
    return load_reference(base_dir)


@pytest.fixture(scope="module")
def voice():
    g = torch.Generator().manual_seed(0)
    t = torch.arange(36000) / 24000
    return (0.3 * torch.sin(2 * torch.pi * 180 * t) + 0.05 * torch.randn(36000, generator=g)).clamp(-1, 1)


def test_speaker_encoder_equals_qwen_tts(base_dir, reference, voice):
    from mstar_qwen_tts.checkpoint import load_tts
    from qwen_tts.core.models.modeling_qwen3_tts import mel_spectrogram

    ours = load_tts(base_dir, progress=False).speaker_encoder
    mels = mel_spectrogram(voice[None], n_fft=1024, num_mels=128, sampling_rate=24000, hop_size=256, win_size=1024,
                           fmin=0, fmax=12000).transpose(1, 2)
    assert (ours.log_mel(voice) - mels[0]).abs().max() < 1e-5
    with torch.no_grad():
        want = reference.speaker_encoder(mels)[0]
    assert want.shape == (64,) and (ours.embed(voice) - want).abs().max() < 1e-5


@pytest.mark.slow
def test_served_clone_codes_equal_qwen_tts_generate(base_dir, reference, tokenizer, voice):
    from mstar_qwen_tts.checkpoint import load_tts

    embedding = load_tts(base_dir, progress=False).speaker_encoder.embed(voice)
    text = "Hello there!"

    async def main():
        async with AsyncEngine(discover()) as engine:
            await engine.load_model("qwen3-tts", LoadOptions(preset="tiny-base"))
            handle = engine.submit("qwen3-tts", {"input": text, "speaker_embedding": embedding.tolist(),
                                                 "do_sample": False, "subtalker_dosample": False,
                                                 "max_frames": FRAMES})
            codes = [out.value for out in [o async for o in handle] if out.name == "codes" and out.value is not None]
            await handle.result()
            return torch.stack(codes)

    got = asyncio.run(main())
    ids = tokenizer.encode(assistant_text(text), add_special_tokens=False).ids
    with torch.no_grad():
        want, _ = reference.generate(
            input_ids=[torch.tensor([ids])], languages=["auto"], speakers=[None], non_streaming_mode=False,
            voice_clone_prompt={"ref_spk_embedding": [embedding], "x_vector_only_mode": [True], "icl_mode": [False],
                                "ref_code": None},
            max_new_tokens=FRAMES, do_sample=False, subtalker_dosample=False)
    assert 1 <= got.shape[0] <= FRAMES - 1 and torch.equal(got, want[0])  # ended by EOS or at max_frames
