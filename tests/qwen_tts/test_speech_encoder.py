"""The 12 Hz tokenizer's encoder (Mimi) gives the codes of the `qwen-tts` package's tokenizer `encode` on the same
audio with the same weights (the tiny preset's `speech_tokenizer/`)."""

import pytest
import torch

from tests.qwen_tts.oracle import load_reference_tokenizer


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return load_reference_tokenizer(tiny_dir)


def _audio(samples: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(samples) / 24000
    return (0.3 * torch.sin(2 * torch.pi * 220 * t) + 0.1 * torch.randn(samples, generator=g)).clamp(-1, 1)


@pytest.mark.parametrize("samples", [36000, 24001, 1000])
def test_codes_equal_qwen_tts_tokenizer_encode(tiny_dir, reference, samples):
    from mstar_qwen_tts.checkpoint import load_speech_encoder

    ours = load_speech_encoder(tiny_dir, progress=False)
    wav = _audio(samples, samples)
    got = ours.encode(wav)
    with torch.no_grad():
        want = reference.encode(wav[None], torch.ones(1, samples, dtype=torch.long)).audio_codes[0]
    frames = -(-samples // 1920)
    assert got.shape == (frames, 4) and want.shape == got.shape
    assert torch.equal(got, want.cpu())
    if samples == 36000:  # the random codebooks are used: many different entries, not one
        assert len(set(got[:, 0].tolist())) > 3 and len(set(got[:, 3].tolist())) > 3
    assert ours.encodes == 1


@pytest.mark.parametrize("change,key", [
    ({"encode_downsample_rate": 960}, "encode_downsample_rate"),
    ({"encoder_valid_num_quantizers": 9}, "encoder_valid_num_quantizers"),
    ({"encoder_config": {"pad_mode": "reflect"}}, "encoder_config.pad_mode"),
    ({"encoder_config": {"num_filters": "4"}}, "encoder_config.num_filters"),
    ({"encoder_config": None}, "encoder_config"),
])
def test_bad_encoder_config_names_the_key(change, key):
    from mstar_qwen_tts.config import SpeechEncoderConfig
    from mstar_qwen_tts.preset import tiny_speech_tokenizer_config

    from mstar_core.errors import ConfigError

    cfg = tiny_speech_tokenizer_config()
    for name, value in change.items():
        if isinstance(value, dict):
            cfg[name].update(value)
        else:
            cfg[name] = value
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        SpeechEncoderConfig.from_hf(cfg)
