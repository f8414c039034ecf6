"""A call's validated loop settings, cached per distinct (options, request settings) so steady steps skip the checks.

A request sends the same settings at each of its steps (π0.5: 11 calls per request), and every
request on a node usually the same options object (the call site's). Validating them once and
keeping the result, with the per-step sigmas as Python floats and float32 step sizes, takes
the checks and the tensor indexing off every step. A bad value is never cached: it is checked,
and refused with the same `RequestError`, at every call that sends it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import attrs
import torch

from mstar_diffusion import params
from mstar_diffusion.guidance import Guidance
from mstar_diffusion.schedules import SigmaTable

#: The request settings that decide the cached part (seed and latent_shape are read by init calls, once a request).
KEYED = ("num_steps", "shift", "guidance_scale", "image_guidance_scale", "cfg_interval", "cfg_renorm", "cfg_renorm_min")


class _Unkeyable(Exception):
    """A value with no exact, immutable key (a tensor, a numpy scalar): validate it every time."""


@attrs.frozen(eq=False)
class LoopSettings:
    """What every step of a loop with these settings shares."""

    steps: int
    guidance: Guidance
    sigmas: torch.Tensor  # float32, steps + 1 (the init role draws at sigmas[0])
    sigma: tuple[float, ...]  # sigmas as Python floats
    dt: tuple[torch.Tensor, ...]  # float32 sigmas[i + 1] - sigmas[i], as the reference schedulers compute it


def _freeze(value: Any) -> Any:
    """An exact hashable key: the type is part of it (1, 1.0 and True validate differently), floats by bits."""
    kind = type(value)
    if kind is float:
        return (float, value.hex())  # -0.0 and NaN keep their identity; NaN is refused anyway
    if value is None or kind in (int, str, bool):
        return (kind, value)
    if kind in (list, tuple, torch.Size):
        return (kind, tuple(_freeze(v) for v in value))
    if kind in (dict, MappingProxyType):
        return (dict, tuple(sorted((k, _freeze(v)) for k, v in value.items())))
    raise _Unkeyable


class SettingsCache:
    """Validated `LoopSettings` per distinct options and request settings (a bounded dict, cleared when full)."""

    def __init__(self, schedule: str, sigmas: SigmaTable, capacity: int = 1024):
        self.schedule = schedule
        self.sigmas = sigmas
        self.capacity = capacity
        self._entries: dict[tuple, LoopSettings] = {}
        # a read-only options view (every call site's) is keyed by identity; it is held so its id is not reused
        self._views: dict[int, tuple[Mapping[str, Any], Any]] = {}
        self.hits = 0
        self.misses = 0

    def get(self, node: str, inputs: Mapping[str, Any], options: Mapping[str, Any]) -> LoopSettings:
        try:
            key = (self._options_key(options), tuple(_freeze(inputs.get(n)) for n in KEYED))
        except _Unkeyable:
            key = None
        found = self._entries.get(key) if key is not None else None
        if found is not None:
            self.hits += 1
            return found
        self.misses += 1
        settings = self._validate(node, inputs, options)  # raises the request's error, nothing is cached
        if key is not None:
            if len(self._entries) >= self.capacity:
                self._entries.clear()
                self._views.clear()
            self._entries[key] = settings
        return settings

    def _options_key(self, options: Mapping[str, Any]) -> Any:
        if type(options) is MappingProxyType:
            view = self._views.get(id(options))
            if view is not None and view[0] is options:
                return view[1]
            key = _freeze(options)
            self._views[id(options)] = (options, key)
            return key
        return _freeze(options)  # a plain dict (options resolved from the env per call) may change: key its content

    def _validate(self, node: str, inputs: Mapping[str, Any], options: Mapping[str, Any]) -> LoopSettings:
        unknown = params.unknown_options(options)
        if unknown:  # a walk's per-call option the engine would otherwise ignore: the model is wrong, not the request
            raise ValueError(f"node '{node}' (engine 'diffusion'): unknown call options {unknown}; "
                             f"known: {', '.join(sorted(params.KNOWN_OPTIONS))}")
        steps = params.num_steps(node, inputs, options)
        shift = params.shift(node, inputs, options)
        guidance = params.guidance(node, inputs, options)
        sigmas = self.sigmas.get(self.schedule, steps, shift)
        return LoopSettings(steps, guidance, sigmas, tuple(sigmas.tolist()), tuple((sigmas[1:] - sigmas[:-1]).unbind(0)))
