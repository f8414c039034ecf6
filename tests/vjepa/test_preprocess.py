"""Video preprocessing (short-side resize, center crop, ImageNet normalisation) against HF, PIL and by hand."""

import asyncio

import pytest
import torch
from mstar_vjepa.model import load_vjepa2_ac
from mstar_vjepa.preprocess import IMAGENET_MEAN, IMAGENET_STD, preprocess_video, resize_short_side

from mstar_core.errors import RequestError
from mstar_core.model import LoadOptions
from mstar_core.runtime import AsyncEngine

MEAN = torch.tensor(IMAGENET_MEAN)[:, None, None]
STD = torch.tensor(IMAGENET_STD)[:, None, None]


@pytest.fixture(autouse=True)
def _preset_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MSTAR_CACHE", str(tmp_path_factory.getbasetemp() / "mstar-cache"))


def _pixels(*shape, seed=0):
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def test_by_hand_crop_and_normalise_when_short_side_already_fits():
    # crop 16 -> short side int(16 * 256 / 224) = 18: an 18 x 24 frame is not resized, only cropped at (1, 4)
    video = _pixels(2, 18, 24, 3)
    expected = (video[:, 1:17, 4:20].permute(0, 3, 1, 2).float() / 255 - MEAN) / STD
    got = preprocess_video(video, 16)
    assert got.shape == (2, 3, 16, 16) and got.dtype == torch.float32
    assert torch.allclose(got, expected, atol=1e-6, rtol=0)
    # channels-first input is the same video
    assert torch.equal(preprocess_video(video.permute(0, 3, 1, 2), 16), got)


def test_by_hand_constant_frames_of_any_size():
    video = torch.tensor([10, 128, 250], dtype=torch.uint8).view(1, 1, 1, 3).expand(3, 41, 57, 3)
    expected = (torch.tensor([10, 128, 250]).float()[:, None, None] / 255 - MEAN) / STD
    got = preprocess_video(video, 16)
    assert got.shape == (3, 3, 16, 16)
    assert torch.allclose(got, expected.expand_as(got), atol=1e-6, rtol=0)


@pytest.mark.parametrize("hw", [(37, 29), (12, 14), (64, 48)])
def test_resize_matches_pil_bilinear(hw):
    pil = pytest.importorskip("PIL.Image")
    import numpy as np

    frames = _pixels(1, 3, *hw, seed=hw[0])
    ours = resize_short_side(frames, 18)[0]
    oh, ow = ours.shape[-2:]
    assert min(oh, ow) == 18 and max(oh, ow) == int(18 * max(hw) / min(hw))
    ref = torch.stack([torch.from_numpy(np.array(pil.fromarray(frames[0, c].numpy()).resize((ow, oh), pil.BILINEAR)))
                       for c in range(3)])
    assert (ours.int() - ref.int()).abs().max() <= 1  # PIL's fixed-point rounding differs by at most one level


def test_matches_transformers_video_processor():
    try:  # needs torchvision, which this project does not install; runs where it is importable
        from transformers import VJEPA2VideoProcessor

        processor = VJEPA2VideoProcessor(crop_size=16)
    except ImportError:
        pytest.skip("transformers' VJEPA2VideoProcessor needs torchvision")
    for shape in [(2, 37, 29, 3), (3, 12, 14, 3), (2, 3, 40, 33)]:
        video = _pixels(*shape, seed=sum(shape))
        ref = processor(video, return_tensors="pt")["pixel_values_videos"][0]
        assert (preprocess_video(video, 16) - ref).abs().max() <= 1e-5


def test_prepare_preprocesses_uint8_and_flagged_frames():
    loaded = load_vjepa2_ac(LoadOptions(preset="tiny"))  # crop 32
    raw = _pixels(2, 45, 60, 3)
    want = preprocess_video(raw, 32)
    assert torch.equal(loaded.prepare_inputs({"frames": raw})["frames"], want)  # uint8: on by default
    as_list = {"frames": raw.tolist(), "preprocess": True}  # JSON-style integers need the flag
    assert torch.equal(loaded.prepare_inputs(as_list)["frames"], want)
    with pytest.raises(RequestError, match="'preprocess' must be true or false"):
        loaded.prepare_inputs({"frames": raw, "preprocess": "yes"})
    with pytest.raises(RequestError, match="'frames'.*outside 0..255"):
        loaded.prepare_inputs({"frames": (raw.int() + 300).tolist(), "preprocess": True})
    with pytest.raises(RequestError, match="'frames'"):
        loaded.prepare_inputs({"frames": _pixels(2, 45, 60, 4)})
    with pytest.raises(RequestError, match="'frames'"):  # without the flag, frames must be at crop size
        loaded.prepare_inputs({"frames": raw.float()})


def test_encode_walk_on_raw_video_equals_preprocessed_input():
    raw = _pixels(2, 20, 27, 3)

    async def go():
        async with AsyncEngine() as engine:
            await engine.load_model("vjepa2", LoadOptions(preset="tiny"))  # crop 16
            a = await engine.submit("vjepa2", {"video": raw}).result()
            b = await engine.submit("vjepa2", {"video": preprocess_video(raw, 16)}).result()
            return a, b

    a, b = asyncio.run(go())
    assert torch.equal(a["latents"], b["latents"])
