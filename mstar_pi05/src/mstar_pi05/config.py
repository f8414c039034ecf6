"""`PolicyConfig`: a LeRobot pi0 / pi0.5 `config.json` (`type: pi0 | pi05`) read into the sizes M* builds.

LeRobot's config names the Gemma sizes by variant (`paligemma_variant: gemma_2b`,
`action_expert_variant: gemma_300m`) and fixes the SigLIP So400m tower; presets at other sizes add a
`mstar_sizes` block (`text`, `expert`: HF Gemma dicts; `vision`: a HF SigLIP vision dict). Training keys
(optimizer, scheduler, features) are LeRobot's business and are ignored; the keys read here are checked
(`mstar_core.config.hf`), errors naming the dotted key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from mstar_core.config.hf import check, config_field, read_fields, section
from mstar_core.errors import ConfigError
from mstar_core.nn.gemma import GemmaConfig
from mstar_core.nn.siglip import SiglipVisionConfig

_GEMMA = {
    "gemma_2b": dict(hidden_size=2048, intermediate_size=16384, num_hidden_layers=18, num_attention_heads=8,
                     num_key_value_heads=1, head_dim=256),
    "gemma_300m": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=18, num_attention_heads=8,
                       num_key_value_heads=1, head_dim=256),
    "dummy": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=1, head_dim=16),
}
_SO400M = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
               image_size=224, patch_size=14)
VOCAB = 257152
TYPES = ("pi0", "pi05")


@attrs.frozen(kw_only=True)
class _Sizes:
    """`mstar_sizes`: M*'s own block (HF dicts for presets at other sizes), so unknown keys are refused."""

    text: Mapping[str, Any] | None = None
    expert: Mapping[str, Any] | None = None
    vision: Mapping[str, Any] | None = None


@attrs.frozen(kw_only=True)
class PolicyConfig:
    type: str
    text: GemmaConfig
    expert: GemmaConfig
    vision: SiglipVisionConfig
    chunk_size: int = config_field(50, minimum=1)
    max_state_dim: int = config_field(32, minimum=1)
    max_action_dim: int = config_field(32, minimum=1)
    num_inference_steps: int = config_field(10, minimum=1)
    tokenizer_max_length: int = config_field(200, minimum=1)
    min_period: float = 4e-3
    max_period: float = 4.0
    raw: Mapping[str, Any] = attrs.field(factory=dict, eq=False, repr=False)

    @property
    def pi05(self) -> bool:
        return self.type == "pi05"

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> PolicyConfig:
        cfg = section(cfg, "")
        kind = cfg.get("type")
        if kind not in TYPES:
            raise ConfigError(f"config.json: key 'type' is {kind!r}; this package serves {list(TYPES)}")
        sizes = read_fields(_Sizes, cfg.get("mstar_sizes"), "mstar_sizes", strict=True)

        def gemma(key: str, variant_key: str, default: str, **extra: Any) -> GemmaConfig:
            given = getattr(sizes, key)
            if given is not None:
                return GemmaConfig.from_hf({"vocab_size": VOCAB, **given}, f"mstar_sizes.{key}", **extra)
            variant = check(cfg.get(variant_key, default), str, variant_key, example=default)
            if variant not in _GEMMA:
                raise ConfigError(f"config.json: key '{variant_key}' is {variant!r}; known: {sorted(_GEMMA)}")
            return GemmaConfig(vocab_size=VOCAB, **_GEMMA[variant], **extra)

        text = gemma("text", "paligemma_variant", "gemma_2b")
        expert_plain = gemma("expert", "action_expert_variant", "gemma_300m")
        cond = expert_plain.hidden_size if kind == "pi05" else None
        expert = attrs.evolve(expert_plain, adarms_cond_dim=cond, vocab_size=text.vocab_size)
        if (text.num_hidden_layers, text.num_key_value_heads, text.head_dim) != (
                expert.num_hidden_layers, expert.num_key_value_heads, expert.head_dim):
            raise ConfigError("config.json: the action expert must match the language model in layers, KV heads and "
                              "head_dim (it attends to the prefix's keys and values layer by layer)")
        vision = SiglipVisionConfig.from_hf(_SO400M if sizes.vision is None else sizes.vision, "mstar_sizes.vision")
        return read_fields(cls, cfg, type=kind, text=text, expert=expert, vision=vision, raw=dict(cfg))
