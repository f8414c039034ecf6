"""Shared media and position blocks: log-mel features, Qwen-VL patches, M-RoPE, against transformers or exact rules."""

import numpy as np
import pytest
import torch

from mstar_core.nn.mrope import MultimodalRotaryEmbedding, mrope_axis_of_frequency
from mstar_core.nn.rotary import RotaryEmbedding
from mstar_core.nn.vision_patch import ImagePatcher
from mstar_core.nn.whisper_features import LogMelFeatures, mel_filters


@pytest.mark.parametrize("samples", [16000, 16000 * 3 + 77])
def test_log_mel_equals_the_whisper_feature_extractor(samples):
    transformers = pytest.importorskip("transformers")
    fe = transformers.WhisperFeatureExtractor(feature_size=128)
    wave = np.random.default_rng(samples).standard_normal(samples).astype(np.float32) * 0.1
    ref = fe(wave, sampling_rate=16000, padding=True, truncation=False, return_tensors="pt")["input_features"][0]
    assert np.abs(mel_filters().numpy() - fe.mel_filters).max() < 1e-6
    out = LogMelFeatures()(torch.from_numpy(wave))
    assert out.shape == ref.shape == (128, samples // 160)
    assert (out - ref).abs().max() < 1e-5


@pytest.mark.parametrize("shape", [(64, 96), (50, 70), (300, 20)])
def test_image_patches_equal_the_qwen_vl_processor(shape):
    transformers = pytest.importorskip("transformers")
    settings = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 4096, "max_pixels": 65536}
    proc = transformers.Qwen2VLImageProcessorPil(**settings, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    image = np.random.default_rng(shape[0]).integers(0, 256, (*shape, 3), dtype=np.uint8)
    ref = proc(images=[image], return_tensors="pt")
    patches, grid = ImagePatcher(min_pixels=4096, max_pixels=65536)(image)
    assert grid == ref["image_grid_thw"][0].tolist()
    assert torch.equal(patches, ref["pixel_values"])


def test_mrope_equals_rope_on_text_and_interleaves_the_axes():
    mrope = MultimodalRotaryEmbedding(16, (2, 3, 3), theta=10000.0)
    rope = RotaryEmbedding(16, {"rope_type": "default", "rope_theta": 10000.0})
    pos = torch.arange(7)
    for a, b in zip(mrope(pos.expand(3, -1)), rope(pos), strict=True):
        assert torch.allclose(a, b)
    assert mrope_axis_of_frequency((24, 20, 20)).tolist()[:7] == [0, 1, 2, 0, 1, 2, 0]
    assert mrope_axis_of_frequency((24, 20, 20)).bincount().tolist() == [24, 20, 20]
    assert mrope_axis_of_frequency((2, 1, 1)).tolist() == [0, 1, 2, 0]
    assert mrope_axis_of_frequency((2, 3, 3), interleaved=False).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    cos, _ = mrope(torch.stack([torch.zeros(1), torch.ones(1), torch.zeros(1)]).long())
    assert cos[0, 1] != 1 and cos[0, 0] == 1 and cos[0, 2] == 1  # only the h frequencies moved
