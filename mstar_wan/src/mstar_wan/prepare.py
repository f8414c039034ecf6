"""Requests: the prompt and negative prompt as UMT5 ids, the latent grid of the asked size, the first frame for TI2V.

Wan's constraints: height and width multiples of 32 (16x VAE compression, then the DiT's 2x2 patches);
`num_frames = 4k + 1` (the VAE's causal 4x temporal compression keeps the first frame alone), giving
`1 + (num_frames - 1) / 4` latent frames.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
import torch

from mstar_core.errors import RequestError
from mstar_core.schema import RequestField, RequestSchema, sampling_fields
from mstar_wan.tokenizer import encode_prompt

MAX_STEPS = 200
MAX_SIDE = 1280 * 2
MAX_FRAMES = 481
MAX_PROMPT = 8192


@attrs.frozen
class Defaults:
    """A checkpoint's serving defaults: the published ones, or a preset's (`mstar_wan.json`)."""

    max_sequence_length: int = 512
    height: int = 704
    width: int = 1280
    num_frames: int = 121
    num_steps: int = 50
    guidance_scale: float = 5.0
    fps: int = 24
    #: OpenAI's sizes are drawn at this scale (a tiny preset serves them at a few dozen pixels)
    size_scale: float = 1.0
    decode_chunk_frames: int = 4

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Defaults:
        known = {f.name for f in attrs.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _frames(value: int, name: str) -> int:
    if (value - 1) % 4:
        raise RequestError(f"'{name}' must be 4k + 1 (1, 5, 9, ..., 121), got {value}", param=name)
    return value


def decode_image(value: Any, name: str = "image") -> Any:
    """An RGB PIL image from PNG/JPEG bytes or an `[H, W, 3]` uint8 (or [0, 1] float) tensor."""
    from PIL import Image

    if isinstance(value, bytes | bytearray):
        try:
            with Image.open(io.BytesIO(value)) as im:
                return im.convert("RGB")
        except Exception:
            raise RequestError(f"'{name}' could not be decoded as an image (send a PNG or JPEG)", param=name) from None
    t = torch.as_tensor(value)
    if t.dim() != 3 or t.shape[-1] != 3 or min(t.shape[:2]) < 1:
        raise RequestError(f"'{name}' must be an RGB image [H, W, 3], got shape {list(t.shape)}", param=name)
    if t.dtype != torch.uint8:
        if not t.dtype.is_floating_point:
            raise RequestError(f"'{name}' must be uint8 or float in [0, 1], got {t.dtype}", param=name)
        t = (t.float().clamp(0, 1) * 255).round().to(torch.uint8)
    return Image.fromarray(t.numpy())


def image_pixels(image: Any, height: int, width: int) -> torch.Tensor:
    """The first frame as the reference prepares it: Lanczos-resized to (width, height), `[3, H, W]` in [-1, 1]."""
    from PIL import Image

    if image.size != (width, height):
        image = image.resize((width, height), resample=Image.LANCZOS)
    array = np.asarray(image, dtype=np.float32) / 255.0
    return torch.from_numpy(array).permute(2, 0, 1) * 2.0 - 1.0


class Preparer:
    def __init__(self, tokenizer, defaults: Defaults, shift: float, z_dim: int, scale_t: int, scale_s: int):
        self.tokenizer = tokenizer
        self.defaults = defaults
        self.z_dim, self.scale_t, self.scale_s = z_dim, scale_t, scale_s
        d = defaults
        self.schema = RequestSchema(
            fields=(
                RequestField("prompt", "string", "what the video shows", required=True, max_length=MAX_PROMPT),
                RequestField("negative_prompt", "string", "what to steer away from (CFG's unconditional branch)",
                             default="", max_length=MAX_PROMPT),
                RequestField("image", "any", "TI2V: the first frame (PNG/JPEG bytes or an [H, W, 3] tensor), resized "
                             "to the video's size"),
                RequestField("height", "integer", "pixels, a multiple of 32", default=d.height, minimum=32,
                             maximum=MAX_SIDE, multiple_of=32),
                RequestField("width", "integer", "pixels, a multiple of 32", default=d.width, minimum=32,
                             maximum=MAX_SIDE, multiple_of=32),
                RequestField("num_frames", "integer", "frames, 4k + 1", default=d.num_frames, minimum=1,
                             maximum=MAX_FRAMES, check=_frames),
                RequestField("num_steps", "integer", "denoising steps", default=d.num_steps, minimum=1,
                             maximum=MAX_STEPS),
                RequestField("guidance_scale", "number", "classifier-free guidance (1 turns it off)",
                             default=d.guidance_scale, minimum=0.0, maximum=30.0),
                RequestField("shift", "number", "flow timestep shift", default=shift, minimum=0.0,
                             exclusive_minimum=True, maximum=100.0),
                RequestField("fps", "integer", "frames per second of the result", default=d.fps, minimum=1,
                             maximum=120),
                *sampling_fields("seed"),
            ),
            example={"prompt": "a red fox running through snow", "num_steps": 2},
            description="Wan2.2 text-to-video, or text+image-to-video with `image`",
        )

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        d = self.defaults
        height, width, frames = inputs["height"], inputs["width"], inputs["num_frames"]
        latent_frames = 1 + (frames - 1) // self.scale_t
        env = {
            "walk": "t2v",
            "prompt_ids": torch.tensor(encode_prompt(self.tokenizer, inputs["prompt"], d.max_sequence_length)),
            "negative_ids": torch.tensor(encode_prompt(self.tokenizer, inputs["negative_prompt"], d.max_sequence_length)),
            "latent_shape": [self.z_dim, latent_frames, height // self.scale_s, width // self.scale_s],
            "num_steps": inputs["num_steps"],
            "guidance_scale": inputs["guidance_scale"],
            "shift": inputs["shift"],
            "decode_chunks": -(-latent_frames // d.decode_chunk_frames),
            "fps": inputs["fps"],
        }
        if inputs.get("seed") is not None:
            env["seed"] = inputs["seed"]
        if inputs.get("image") is not None:
            env["walk"] = "i2v"
            env["image"] = image_pixels(decode_image(inputs["image"]), height, width)
        return env
