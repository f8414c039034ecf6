"""Bounds on what a request may carry, and the one rule by which `MSTAR_<AREA>_<NAME>` environment variables
override them (media here, video in `video.py`, realtime sessions in `realtime/limits.py`): the operator's last
word, read once at startup, a bad value a ConfigError naming the variable."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from mstar_core import strict
from mstar_core.errors import ConfigError


def positive_number(field: attrs.Attribute, raw: str, where: str) -> int | float:
    """An environment value for an int or float field: a number, and positive (`mstar_core.strict`'s rule)."""
    return strict.positive_number(raw, where, int if field.type in (int, "int") else float)


def env_overrides(limits_class: type, prefix: str, environ: Mapping[str, str] | None = None,
                  parse: Callable[[attrs.Attribute, str, str], Any] = positive_number) -> dict[str, Any]:
    """The fields of the attrs class `limits_class` that `<prefix><FIELD NAME>` environment variables set (blank
    ones left out), each parsed by `parse(field, raw, "environment variable NAME")`."""
    environ = os.environ if environ is None else environ
    changes: dict[str, Any] = {}
    for field in attrs.fields(limits_class):
        name = f"{prefix}{field.name.upper()}"
        raw = environ.get(name)
        if raw is not None and raw.strip():
            changes[field.name] = parse(field, raw, f"environment variable {name}")
    return changes


@attrs.frozen
class MediaLimits:
    """Per-request bounds on chat media: the adapter's, then `with_settings` (deploy file), then `with_env`."""

    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096
    max_audio_bytes: int = 25 * 1024 * 1024
    max_audio_seconds: float = 600.0
    #: media parts (images and audio) in one request, all messages together
    max_parts: int = 32
    #: remote http(s) image URLs starting with one of these are fetched; any other remote URL is a 400
    url_prefixes: tuple[str, ...] = ()
    fetch_timeout: float = 10.0

    def with_settings(self, settings: Mapping[str, Any] | None, where: str) -> MediaLimits:
        """These limits with a deploy file's `media:` section applied; a bad key or value is a ConfigError naming it."""
        if not settings:
            return self
        if not isinstance(settings, Mapping):
            raise ConfigError(f"{where} must be a mapping of media limits")
        names = [f.name for f in attrs.fields(MediaLimits)]
        unknown = sorted(set(settings) - set(names))
        if unknown:
            raise ConfigError(f"unknown key(s) {unknown} in {where}; allowed: {names}")
        return attrs.evolve(self, **{k: _limit(k, v, f"{where}.{k}") for k, v in settings.items()})

    def with_env(self, environ: Mapping[str, str] | None = None) -> MediaLimits:
        """These limits with `MSTAR_MEDIA_MAX_IMAGE_BYTES`, `_MAX_IMAGE_PIXELS`, `_MAX_AUDIO_BYTES`,
        `_MAX_AUDIO_SECONDS`, `_MAX_PARTS`, `_FETCH_TIMEOUT` and `_URL_PREFIXES` (comma-separated) applied."""
        changes = env_overrides(MediaLimits, "MSTAR_MEDIA_", environ, _env_limit)
        return attrs.evolve(self, **changes) if changes else self


_FLOAT_LIMITS = ("max_audio_seconds", "fetch_timeout")


def _limit(name: str, value: Any, where: str) -> Any:
    """One limit's value checked: positive counts and durations, URL prefixes as a list of http(s) strings."""
    if name == "url_prefixes":
        if not isinstance(value, list | tuple) or not all(
                isinstance(p, str) and p.startswith(("http://", "https://")) for p in value):
            raise ConfigError(f"{where} must be a list of URL prefixes starting with http:// or https://, "
                              f"got {value!r}")
        return tuple(value)
    kinds = (int, float) if name in _FLOAT_LIMITS else (int,)
    if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
        what = "a positive number" if name in _FLOAT_LIMITS else "a positive integer"
        raise ConfigError(f"{where} must be {what}, got {value!r}")
    return float(value) if name in _FLOAT_LIMITS else value


def _env_limit(field: attrs.Attribute, raw: str, where: str) -> Any:
    if field.name == "url_prefixes":
        return _limit(field.name, [p.strip() for p in raw.split(",") if p.strip()], where)
    try:
        value: Any = float(raw) if field.name in _FLOAT_LIMITS else int(raw)
    except ValueError:
        value = raw
    return _limit(field.name, value, where)
