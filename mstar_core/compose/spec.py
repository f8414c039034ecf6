"""`CompositionSpec`: a model made of other loaded models' nodes, as a plugin registers it.

A composition names its roles (`asr`, `llm`, `tts`); a deploy file (or `AsyncEngine.compose`) fills each role with a
model already loaded, and may set the options the composition declares. `build(name, parts, options)` returns the composed `LoadedModel`: one graph whose nodes are the parts'
nodes under `<role>/<node>` (`mstar_core.graph.compose`) plus the composition's own glue nodes. The runtime serves
those part nodes with the parts' own engines and schedulers (one copy of the weights, one batch across the
standalone model's requests and the composed model's), and builds engines only for the glue.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from mstar_core.errors import ConfigError
from mstar_core.model import LoadedModel


@attrs.frozen
class CompositionSpec:
    """A composition kind (`mstar_register_compositions`): its roles and how it builds the composed model."""

    name: str
    roles: tuple[str, ...] = attrs.field(converter=tuple)
    build: Callable[[str, Mapping[str, LoadedModel], Mapping[str, Any]], LoadedModel] = attrs.field(eq=False)
    description: str = ""
    #: the options a deploy file may set (`options:`), each with what it means; `build` checks their values
    options: Mapping[str, str] = attrs.field(factory=dict, eq=False)
    #: what each role must be, said in the error when a deploy file leaves it out
    role_help: Mapping[str, str] = attrs.field(factory=dict, eq=False)


def check_roles(spec: CompositionSpec, parts: Mapping[str, Any], where: str,
                options: Mapping[str, Any] | None = None) -> None:
    """Every role filled, no other key, only declared options: a `ConfigError` naming the offending key otherwise."""
    for key in options or {}:
        if key not in spec.options:
            known = ", ".join(f"{k} ({v})" for k, v in spec.options.items()) or "none"
            raise ConfigError(f"{where}.options.{key}: composition '{spec.name}' has no option '{key}'; its options: "
                              f"{known}")
    unknown = sorted(set(parts) - set(spec.roles))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: composition '{spec.name}' has no role '{unknown[0]}'; its roles: "
                          f"{', '.join(spec.roles)}")
    missing = [r for r in spec.roles if r not in parts]
    if missing:
        help_ = spec.role_help.get(missing[0])
        raise ConfigError(f"{where}.{missing[0]} is missing: composition '{spec.name}' needs a model for role "
                          f"'{missing[0]}'{f' ({help_})' if help_ else ''}; its roles: {', '.join(spec.roles)}")
    for role, model in parts.items():
        if not isinstance(model, str) or not model:
            raise ConfigError(f"{where}.{role} must name a loaded model, got {model!r}")
