"""The request: its fields declared once (`request_schema`, checked by the runtime before `prepare` runs), and
`prepare`, which turns the checked fields into the env the `prefill` walk reads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from mstar_core.errors import RequestError
from mstar_core.sampling import SamplingParams
from mstar_core.schema import RequestField, RequestSchema, sampling_fields
from mstar_example_captioner.config import CaptionerConfig
from mstar_example_captioner.tokenizer import BOS, EOS, IMAGE, CharTokenizer

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed")
DEFAULT_PROMPT = "A picture of"
DEFAULT_MAX_TOKENS = 32
MAX_PROMPT_CHARS = 256
IMAGE_FORMAT = "an RGB image [H, W, 3]: integer pixels 0..255, or floats in [0, 1]"
#: A 2x2 image (red, green / blue, white) in the native tensor format, and a short caption.
EXAMPLE = {"image": {"dtype": "uint8", "shape": [2, 2, 3], "data": "/wAAAP8AAAD/////"}, "max_tokens": 8}


def _image(t: torch.Tensor, name: str = "image") -> torch.Tensor:
    """`image` as float `[3, H, W]` in [0, 1] from uint8 pixels `[H, W, 3]` (0..255) or floats in [0, 1]."""
    what = IMAGE_FORMAT
    if t.dim() != 3 or t.shape[2] != 3 or t.shape[0] < 2 or t.shape[1] < 2:
        raise RequestError(f"'image' has shape {list(t.shape)}; send {what} (H, W >= 2)", param="image")
    if t.is_floating_point():
        t = t.float()
        if not torch.isfinite(t).all() or t.min() < 0 or t.max() > 1:
            raise RequestError(f"'image' has float values outside [0, 1]; send {what}", param="image")
    elif t.dtype != torch.bool and not t.is_complex():  # uint8, or the int64 a JSON list of ints becomes
        if t.min() < 0 or t.max() > 255:
            raise RequestError(f"'image' has integer values outside 0..255; send {what}", param="image")
        t = t.float() / 255
    else:
        raise RequestError(f"'image' has dtype {t.dtype}; send {what}", param="image")
    return t.permute(2, 0, 1)


def views(image: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole image and its centre crop (half the shorter side), each resized to `size` and normalised to [-1, 1]."""
    _, h, w = image.shape
    side = max(min(h, w) // 2, 1)
    top, left = (h - side) // 2, (w - side) // 2
    crop = image[:, top : top + side, left : left + side]

    def fit(x: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x[None], size=(size, size), mode="bilinear", align_corners=False, antialias=True)[0]
        return (x - 0.5) / 0.5

    return fit(image), fit(crop)


@attrs.define
class CaptionRequestPreparer:
    """Validates a captioning request and lays out the prompt: `<bos> <image>*2N prompt-text`."""

    config: CaptionerConfig
    tokenizer: CharTokenizer = attrs.field(factory=CharTokenizer)

    def prompt_ids(self, prompt: str) -> list[int]:
        return [BOS, *[IMAGE] * (2 * self.config.tokens_per_view), *self.tokenizer.encode(prompt)]

    @property
    def schema(self) -> RequestSchema:
        """The request fields: the runtime checks them (and fills defaults) before `__call__` sees them."""
        return RequestSchema(
            fields=(
                RequestField("image", "tensor", IMAGE_FORMAT, required=True, check=_image),
                RequestField("prompt", "string", "text after the image, continued by the caption",
                             default=DEFAULT_PROMPT, max_length=MAX_PROMPT_CHARS, check=self._prompt_ids),
                RequestField("ignore_eos", "boolean", "keep generating past <eos>", default=False),
                *sampling_fields(*SAMPLING_FIELDS, defaults={"max_tokens": DEFAULT_MAX_TOKENS}),
            ),
            example=EXAMPLE,
            description="captions an image: streams `text` (and `next_token`) as the decoder writes",
        )

    def _prompt_ids(self, prompt: str, name: str) -> str:
        try:
            self.tokenizer.encode(prompt)
        except ValueError as exc:
            raise RequestError(f"'{name}': {exc}", param=name) from None
        return prompt

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        global_view, detail_view = views(inputs["image"], self.config.vision.image_size)
        ids = self.prompt_ids(inputs["prompt"])
        fields = {k: inputs[k] for k in SAMPLING_FIELDS if k in inputs}
        sampling = SamplingParams(**fields, stop_token_ids=() if inputs["ignore_eos"] else (EOS,))
        sampling.check_vocab(self.config.text.vocab_size)
        room = self.config.text.max_position_embeddings - len(ids)
        if sampling.max_tokens > room:
            raise RequestError(f"'max_tokens' is {sampling.max_tokens}; with this prompt at most {room} fit",
                               param="max_tokens")
        return {"global_view": global_view, "detail_view": detail_view, "prompt_ids": ids, "sampling": sampling}
