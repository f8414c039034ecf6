"""`CaptionerConfig`: the checkpoint's `config.json`, read strictly (a bad key is a `ConfigError` naming it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from mstar_core.config.hf import check, config_field, read_fields, section
from mstar_core.errors import ConfigError
from mstar_core.nn import LlamaConfig
from mstar_core.strict import reject_unknown

_TOP_KEYS = ("model_type", "vision_config", "text_config", "image_token_id")


@attrs.frozen(kw_only=True)
class VisionConfig:
    """`vision_config`: the example's own section, so read strictly (an unknown key is a typo)."""

    image_size: int = config_field(minimum=1)
    patch_size: int = config_field(minimum=1)
    hidden_size: int = config_field(minimum=1)
    num_layers: int = config_field(minimum=1)
    num_heads: int = config_field(minimum=1)
    intermediate_size: int = config_field(minimum=1)

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
        """Read `config.json`; a missing, unknown or wrong-typed key is a `ConfigError` naming it."""
        cfg = section(cfg, "")
        reject_unknown(cfg, _TOP_KEYS, "config.json")
        model_type = check(cfg.get("model_type"), str, "model_type", example="example-captioner")
        if model_type != "example-captioner":
            raise ConfigError(f"config.json: key 'model_type' must be 'example-captioner', got {model_type!r}")
        vision = read_fields(VisionConfig, cfg.get("vision_config"), "vision_config", strict=True)
        if vision.image_size % vision.patch_size or vision.hidden_size % vision.num_heads:
            raise ConfigError("config.json: 'vision_config' needs image_size % patch_size == 0 and "
                              "hidden_size % num_heads == 0")
        text = LlamaConfig.from_hf(check(cfg.get("text_config"), dict, "text_config"), where="text_config")
        image_token = check(cfg.get("image_token_id"), int, "image_token_id", minimum=0)
        if image_token >= text.vocab_size:
            raise ConfigError(f"config.json: key 'image_token_id' must be a token id below {text.vocab_size}, "
                              f"got {image_token}")
        return cls(vision=vision, text=text, image_token_id=image_token, raw=dict(cfg))
