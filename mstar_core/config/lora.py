"""A model's LoRA settings in the deploy file (`models.NAME`): adapters loaded at startup and the slots' bounds.

Keys, as vLLM's flags: `lora_adapters: {name: PEFT directory}`, `max_loras` (adapters held at once),
`max_lora_rank` (the largest rank an adapter may have). Any of them turns LoRA on for the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from mstar_core.errors import ConfigError
from mstar_core.strict import reject_unknown

DEPLOY_KEYS = ("lora_adapters", "max_loras", "max_lora_rank")
DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_LORA_RANK = 16


@attrs.frozen(kw_only=True)
class LoraSettings:
    """A model's LoRA settings from its deploy-file entry: adapters loaded at startup and the bounds of the slots."""

    adapters: Mapping[str, str] = attrs.field(factory=dict)
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK

    @classmethod
    def from_deploy(cls, spec: Mapping[str, Any], where: str) -> LoraSettings | None:
        """The LoRA keys of one model's deploy entry (None when it has none); errors name the key."""
        if not any(k in spec for k in DEPLOY_KEYS):
            return None
        adapters = spec.get("lora_adapters") or {}
        if not isinstance(adapters, Mapping) or not all(isinstance(k, str) and k and isinstance(v, str) and v
                                                        for k, v in adapters.items()):
            raise ConfigError(f"{where}.lora_adapters must map adapter names to PEFT adapter directories, "
                              f"got {adapters!r:.80}")
        values = {}
        for key, default in (("max_loras", DEFAULT_MAX_LORAS), ("max_lora_rank", DEFAULT_MAX_LORA_RANK)):
            value = spec.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{where}.{key} must be an integer >= 1, got {value!r}")
            values[key] = value
        if len(adapters) > values["max_loras"]:
            raise ConfigError(f"{where}.lora_adapters names {len(adapters)} adapters, over max_loras "
                              f"{values['max_loras']}")
        return cls(adapters=dict(adapters), **values)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str) -> LoraSettings:
        """The same keys as a mapping of their own (strict: an unknown key is named)."""
        reject_unknown(data, DEPLOY_KEYS, where)
        return cls.from_deploy(data, where) or cls()
