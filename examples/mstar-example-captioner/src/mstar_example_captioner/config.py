"""`CaptionerConfig`: the checkpoint's `config.json`, read strictly (a bad key is a `ConfigError` naming it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from mstar_core.errors import ConfigError
from mstar_core.nn import LlamaConfig

_VISION_KEYS = ("image_size", "patch_size", "hidden_size", "num_layers", "num_heads", "intermediate_size")
_TOP_KEYS = ("model_type", "vision_config", "text_config", "image_token_id")


@attrs.frozen(kw_only=True)
class VisionConfig:
    image_size: int
    patch_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@attrs.frozen(kw_only=True)
class CaptionerConfig:
    vision: VisionConfig
    text: LlamaConfig
    image_token_id: int
    raw: Mapping[str, Any] = attrs.field(eq=False, repr=False)

    @property
    def tokens_per_view(self) -> int:
        """Embedding rows the vision tower produces per view (one per patch)."""
        return self.vision.num_patches

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> CaptionerConfig:
        unknown = sorted(set(cfg) - set(_TOP_KEYS))
        if unknown:
            raise ConfigError(f"config.json: unknown key(s) {unknown}; known: {list(_TOP_KEYS)}")
        if cfg.get("model_type") != "example-captioner":
            raise ConfigError(f"config.json: 'model_type' must be 'example-captioner', got {cfg.get('model_type')!r}")
        vision = cfg.get("vision_config")
        if not isinstance(vision, Mapping):
            raise ConfigError("config.json: 'vision_config' must be an object")
        values = {}
        for key in _VISION_KEYS:
            value = vision.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"config.json: 'vision_config.{key}' must be a positive integer, got {value!r}")
            values[key] = value
        if values["image_size"] % values["patch_size"] or values["hidden_size"] % values["num_heads"]:
            raise ConfigError("config.json: 'vision_config' needs image_size % patch_size == 0 and "
                              "hidden_size % num_heads == 0")
        text = cfg.get("text_config")
        if not isinstance(text, Mapping):
            raise ConfigError("config.json: 'text_config' must be an object (a Llama config)")
        text_cfg = LlamaConfig.from_hf(text)
        image_token = cfg.get("image_token_id")
        if not isinstance(image_token, int) or not 0 <= image_token < text_cfg.vocab_size:
            raise ConfigError(f"config.json: 'image_token_id' must be a token id below {text_cfg.vocab_size}")
        return cls(vision=VisionConfig(**values), text=text_cfg, image_token_id=image_token, raw=dict(cfg))
