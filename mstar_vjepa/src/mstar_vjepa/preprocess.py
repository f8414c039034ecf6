"""Video preprocessing of HF `VJEPA2VideoProcessor` / upstream eval transforms, in plain torch.

Pixel values 0..255 (uint8 or float), frames `[T, H, W, C]` or `[T, C, H, W]` of any size: resize the short
side to `int(crop * 256 / 224)` (bilinear, antialiased; uint8 stays uint8, rounded, as torchvision does), center
crop to `crop x crop`, scale to [0, 1], then ImageNet mean/std normalisation. Returns float32 `[T, C, crop, crop]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def resize_size(crop_size: int) -> int:
    """The short side frames are resized to before the center crop."""
    return int(crop_size * 256 / 224)


def channels_first(frames: torch.Tensor, channels: int) -> torch.Tensor:
    """`[T, C, H, W]` or `[T, H, W, C]` -> `[T, C, H, W]` (channels-first wins when both could match, as in HF)."""
    if frames.dim() != 4:
        raise ValueError(f"expected frames [T, H, W, {channels}] or [T, {channels}, H, W], got {tuple(frames.shape)}")
    if frames.shape[1] == channels:
        return frames
    if frames.shape[-1] == channels:
        return frames.permute(0, 3, 1, 2)
    raise ValueError(f"expected frames [T, H, W, {channels}] or [T, {channels}, H, W], got {tuple(frames.shape)}")


def resize_short_side(frames: torch.Tensor, size: int) -> torch.Tensor:
    """Resize `[T, C, H, W]` so the short side is `size` (long side truncated, as HF); dtype is kept."""
    h, w = frames.shape[-2:]
    short, long = min(h, w), max(h, w)
    new_long = int(size * long / short)
    out_hw = (new_long, size) if w <= h else (size, new_long)
    if (h, w) == out_hw:
        return frames
    if frames.dtype == torch.uint8 and frames.device.type == "cpu":
        # torch's native uint8 kernel (fixed-point, as torchvision and PIL use): bit-identical to HF on CPU
        return F.interpolate(frames, size=out_hw, mode="bilinear", align_corners=False, antialias=True)
    out = F.interpolate(frames.float(), size=out_hw, mode="bilinear", align_corners=False, antialias=True)
    if frames.dtype == torch.uint8:  # uint8 stays uint8, rounded (off by at most one level from the CPU kernel)
        return out.round_().clamp_(0, 255).to(torch.uint8)
    return out


def center_crop(frames: torch.Tensor, crop: int) -> torch.Tensor:
    """The central `crop x crop` window (top/left offsets rounded down)."""
    h, w = frames.shape[-2:]
    if h < crop or w < crop:
        raise ValueError(f"frames of {h}x{w} are smaller than the {crop}x{crop} crop")
    top, left = int((h - crop) / 2), int((w - crop) / 2)
    return frames[..., top : top + crop, left : left + crop]


def preprocess_video(frames: torch.Tensor, crop_size: int, channels: int = 3) -> torch.Tensor:
    """Pixel frames (0..255) of any size -> normalised float32 `[T, C, crop, crop]` ready for the encoder."""
    if channels != len(IMAGENET_MEAN):
        raise ValueError(f"ImageNet normalisation needs 3 channels, the model has {channels}")
    x = center_crop(resize_short_side(channels_first(frames, channels), resize_size(crop_size)), crop_size)
    mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float32, device=x.device)[:, None, None]
    std = torch.tensor(IMAGENET_STD, dtype=torch.float32, device=x.device)[:, None, None]
    return (x.float() / 255.0 - mean) / std
