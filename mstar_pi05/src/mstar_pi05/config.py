"""`PolicyConfig`: a LeRobot pi0 / pi0.5 `config.json` (`type: pi0 | pi05`) read into the sizes M* builds.

LeRobot's config names the Gemma sizes by variant (`paligemma_variant: gemma_2b`,
`action_expert_variant: gemma_300m`) and fixes the SigLIP So400m tower; presets at other sizes add a
`mstar_sizes` block (`text`, `expert`: HF Gemma dicts; `vision`: a HF SigLIP vision dict). Training keys
(optimizer, scheduler, features) are LeRobot's business and are ignored; the keys read here are checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

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


def _int(cfg: Mapping[str, Any], key: str, default: int) -> int:
    value = cfg.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config.json: key '{key}' must be a positive integer, got {value!r}")
    return value


@attrs.frozen(kw_only=True)
class PolicyConfig:
    type: str
    text: GemmaConfig
    expert: GemmaConfig
    vision: SiglipVisionConfig
    chunk_size: int = 50
    max_state_dim: int = 32
    max_action_dim: int = 32
    num_inference_steps: int = 10
    tokenizer_max_length: int = 200
    min_period: float = 4e-3
    max_period: float = 4.0
    raw: Mapping[str, Any] = attrs.field(factory=dict, eq=False, repr=False)

    @property
    def pi05(self) -> bool:
        return self.type == "pi05"

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> PolicyConfig:
        kind = cfg.get("type")
        if kind not in TYPES:
            raise ConfigError(f"config.json: key 'type' is {kind!r}; this package serves {list(TYPES)}")
        sizes = cfg.get("mstar_sizes") or {}
        unknown = sorted(set(sizes) - {"text", "expert", "vision"})
        if unknown:
            raise ConfigError(f"config.json: unknown keys {unknown} in 'mstar_sizes'; known: text, expert, vision")

        def gemma(key: str, variant_key: str, default: str, **extra: Any) -> GemmaConfig:
            if key in sizes:
                return GemmaConfig.from_hf({"vocab_size": VOCAB, **sizes[key]}, **extra)
            variant = cfg.get(variant_key, default)
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
        vision = SiglipVisionConfig.from_hf(sizes.get("vision", _SO400M))
        return cls(
            type=kind, text=text, expert=expert, vision=vision,
            chunk_size=_int(cfg, "chunk_size", 50),
            max_state_dim=_int(cfg, "max_state_dim", 32),
            max_action_dim=_int(cfg, "max_action_dim", 32),
            num_inference_steps=_int(cfg, "num_inference_steps", 10),
            tokenizer_max_length=_int(cfg, "tokenizer_max_length", 200),
            raw=dict(cfg),
        )
