"""A composed model in the deploy file (`models.NAME` with `compose:`): which composition, which loaded model fills
each of its roles, and settings for the composition's own nodes.

    models:
      whisper: {preset: tiny}
      llama: {preset: tiny}
      qwen3-tts: {preset: tiny}
      agent: {compose: voice_agent, asr: whisper, llm: llama, tts: qwen3-tts,
              options: {max_words: 16}}   # the composition's own options (voice_agent: its text chunk policy...)

Every other key of the entry is a role, naming another (not composed) model of the same file; whether the
composition has that role is checked once the plugins are known (`mstar_core.compose.check_roles`), the error naming
the key either way.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import attrs

from mstar_core.errors import ConfigError

COMPOSE_KEY = "compose"
#: the keys of a composed entry that are not roles
OWN_KEYS = (COMPOSE_KEY, "engines", "options")


@attrs.frozen
class ComposeSettings:
    composition: str
    parts: Mapping[str, str] = attrs.field(converter=dict)
    #: engine settings of the composition's own nodes (a part's nodes are tuned on the part's model)
    engines: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict, converter=dict)
    #: the composition's own options (`CompositionSpec.options`: checked by name once the plugins are known)
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)

    @classmethod
    def from_deploy(cls, spec: Mapping[str, Any], where: str, models: Mapping[str, Mapping[str, Any] | None]
                    ) -> ComposeSettings:
        """One composed entry of the deploy file; `models` is every entry of the file (parts must be among them)."""
        composition = spec.get(COMPOSE_KEY)
        if not isinstance(composition, str) or not composition:
            raise ConfigError(f"{where}.{COMPOSE_KEY} must name a composition (e.g. voice_agent), got {composition!r}")
        engines = spec.get("engines") or {}
        if not isinstance(engines, Mapping) or not all(isinstance(v, Mapping) for v in engines.values()):
            raise ConfigError(f"{where}.engines must map the composition's own node names to settings mappings")
        options = spec.get("options") or {}
        if not isinstance(options, Mapping):
            raise ConfigError(f"{where}.options must be a mapping of the composition's options, got {options!r:.60}")
        parts = {k: v for k, v in spec.items() if k not in OWN_KEYS}
        if not parts:
            raise ConfigError(f"{where}: a composed model names the model of each role of '{composition}' "
                              "(e.g. asr: whisper, llm: llama, tts: qwen3-tts)")
        for role, model in parts.items():
            if not isinstance(model, str) or not model:
                raise ConfigError(f"{where}.{role} must name another model of this file, got {model!r}")
            if model not in models:
                raise ConfigError(f"{where}.{role}: model '{model}' is not in this file's models "
                                  f"({', '.join(sorted(models))}); add it there, it loads before '{where}'")
            if isinstance(models[model], Mapping) and COMPOSE_KEY in models[model]:
                raise ConfigError(f"{where}.{role}: model '{model}' is composed itself; a part is a loaded model")
        return cls(composition, parts, {k: dict(v) for k, v in engines.items()}, dict(options))

    def check_served(self, served: Collection[str], where: str) -> None:
        """Every part is among the models the server loads."""
        for role, model in self.parts.items():
            if model not in served:
                raise ConfigError(f"{where}.{role}: model '{model}' is not served; serve it too (models served: "
                                  f"{', '.join(served)})")
