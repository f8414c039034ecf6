"""`prepare`: a request's raw fields -> the env the `prefill` walk reads; every refusal is a `RequestError`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from mstar_core.errors import RequestError
from mstar_core.sampling import SamplingParams
from mstar_example_captioner.config import CaptionerConfig
from mstar_example_captioner.tokenizer import BOS, EOS, IMAGE, CharTokenizer

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed")
FIELDS = ("image", "prompt", "ignore_eos", *SAMPLING_FIELDS)
DEFAULT_PROMPT = "A picture of"
DEFAULT_MAX_TOKENS = 32
MAX_PROMPT_CHARS = 256


def _image(value: Any) -> torch.Tensor:
    """`image` as float `[3, H, W]` in [0, 1] from uint8 pixels `[H, W, 3]` (0..255) or floats in [0, 1]."""
    what = "an RGB image [H, W, 3]: integer pixels 0..255, or floats in [0, 1]"
    if value is None:
        raise RequestError(f"missing field 'image': {what}", param="image")
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise RequestError(f"'image' is not a numeric array; send {what}", param="image") from None
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

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(inputs, Mapping):
            raise RequestError(f"request inputs must be an object, got {type(inputs).__name__}")
        unknown = sorted(set(inputs) - set(FIELDS))
        if unknown:
            raise RequestError(f"unknown field(s) {unknown}; this model takes {list(FIELDS)}")
        global_view, detail_view = views(_image(inputs.get("image")), self.config.vision.image_size)
        prompt = inputs.get("prompt", DEFAULT_PROMPT)
        if not isinstance(prompt, str) or len(prompt) > MAX_PROMPT_CHARS:
            raise RequestError(f"'prompt' must be a string of at most {MAX_PROMPT_CHARS} characters", param="prompt")
        try:
            ids = self.prompt_ids(prompt)
        except ValueError as exc:
            raise RequestError(f"'prompt': {exc}", param="prompt") from None
        ignore_eos = inputs.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise RequestError(f"'ignore_eos' must be true or false, got {ignore_eos!r}", param="ignore_eos")
        fields = {k: inputs[k] for k in SAMPLING_FIELDS if inputs.get(k) is not None}
        fields.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
        # SamplingParams checks every field's type and bounds and raises RequestError naming it
        sampling = SamplingParams(**fields, stop_token_ids=() if ignore_eos else (EOS,))
        sampling.check_vocab(self.config.text.vocab_size)
        room = self.config.text.max_position_embeddings - len(ids)
        if sampling.max_tokens > room:
            raise RequestError(f"'max_tokens' is {sampling.max_tokens}; with this prompt at most {room} fit",
                               param="max_tokens")
        return {"global_view": global_view, "detail_view": detail_view, "prompt_ids": ids, "sampling": sampling}
