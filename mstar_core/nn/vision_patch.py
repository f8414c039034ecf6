"""Qwen-VL image patching: an RGB image -> flattened patches in spatial-merge-block order, and its `grid_thw`.

The image is resized (bicubic) so each side is a multiple of `patch * merge` and the pixel count lies in
`[min_pixels, max_pixels]` (aspect ratio kept as closely as the rounding allows), scaled to [0, 1],
normalised by `mean` / `std`, repeated `temporal_patch` times (a still image is a clip of identical frames)
and cut into `temporal_patch x patch x patch` patches, listed so each `merge x merge` block of neighbours
is consecutive (what the vision tower's merger expects). Row layout: `[C, temporal, patch, patch]` flattened.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np
import torch


def fit_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(h, w): multiples of `factor` near (height, width) with h * w in [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image aspect ratio {max(height, width) / min(height, width):.0f} is above 200")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def patchify(pixels: torch.Tensor, patch: int, temporal_patch: int, merge: int) -> tuple[torch.Tensor, list[int]]:
    """`[frames, C, H, W]` normalised pixels -> (`[t * h * w, C * temporal * patch^2]` patches, `[t, h, w]`)."""
    if pixels.shape[0] % temporal_patch:
        pixels = torch.cat([pixels, pixels[-1:].expand(temporal_patch - pixels.shape[0] % temporal_patch, -1, -1, -1)])
    frames, c, height, width = pixels.shape
    t, h, w = frames // temporal_patch, height // patch, width // patch
    x = pixels.reshape(t, temporal_patch, c, h // merge, merge, patch, w // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * h * w, c * temporal_patch * patch * patch), [t, h, w]


@attrs.frozen
class ImagePatcher:
    """Turns `[H, W, 3]` uint8 images into the vision tower's input (settings from `preprocessor_config.json`)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: Sequence[float] = (0.5, 0.5, 0.5)
    image_std: Sequence[float] = (0.5, 0.5, 0.5)

    def size_for(self, height: int, width: int) -> tuple[int, int]:
        return fit_size(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)

    def __call__(self, image: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        from PIL import Image

        array = np.asarray(image)
        if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
            raise ValueError(f"an image must be [H, W, 3] uint8, got {list(array.shape)} {array.dtype}")
        h, w = self.size_for(array.shape[0], array.shape[1])
        if (h, w) != array.shape[:2]:
            array = np.asarray(Image.fromarray(array).resize((w, h), resample=Image.Resampling.BICUBIC))
        x = torch.from_numpy(array.astype(np.float32) / 255.0).permute(2, 0, 1)
        mean = torch.tensor(list(self.image_mean)).view(3, 1, 1)
        std = torch.tensor(list(self.image_std)).view(3, 1, 1)
        return patchify(((x - mean) / std)[None], self.patch_size, self.temporal_patch_size, self.merge_size)
