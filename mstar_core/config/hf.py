"""Checkpoint config sections (`config.json` and friends) read into attrs classes, every key type-checked.

The class is the schema. A field's annotation is the type its key must have: `bool`; `int` (never a bool);
`float` (ints accepted); `str`; `tuple[int, ...]` / `list[...]` (a JSON list); `X | None`; a mapping; a
nested attrs class (a JSON object read by the same rules). Its default applies when the key is absent or
null; `config_field` adds a lower bound or reads another key name. Errors name the file and the dotted key
and show the expected shape, so a bad checkpoint fails at load, not deep inside a forward.
Hugging Face configs carry many generic keys (architectures, dtype, ...), so undeclared keys are ignored;
`strict=True` refuses them, for sections M* itself defines, where an unknown key is a typo.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from mstar_core.errors import ConfigError
from mstar_core.strict import reject_unknown

_MIN, _WHY, _KEY = "mstar_config_min", "mstar_config_why", "mstar_config_key"
_PLURAL = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}


def config_field(default: Any = attrs.NOTHING, *, minimum: int | float | None = None, why: str = "",
                 key: str | None = None) -> Any:
    """An attrs field the reader bounds below by `minimum` (`why` explains it) and reads from `key` if given."""
    return attrs.field(default=default, metadata={_MIN: minimum, _WHY: why, _KEY: key})


def dotted(where: str, key: str) -> str:
    """`key` inside section `where` ('' = the top level)."""
    return f"{where}.{key}" if where else key


def _shown(value: Any) -> str:
    # JSON spelling: the user edits a JSON file, and "8" vs 8 is the whole point of the message
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def describe(kind: Any) -> str:
    """The JSON shape a type annotation asks for, in words ('an integer', 'a list of integers', ...)."""
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string", Any: "any value"}
    if kind in words:
        return words[kind]
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        arms = [describe(a) for a in args if a is not type(None)]
        return " or ".join(arms) + (" or null" if type(None) in args else "")
    if kind in (tuple, list) or origin in (tuple, list):
        inner = args[0] if args else None
        return f"a list of {_PLURAL[inner]}" if inner in _PLURAL else "a list"
    return "an object"


def _match(value: Any, kind: Any) -> tuple[bool, Any]:
    """(whether `value` has the shape `kind` asks for, the value converted: ints to float, lists to tuples)."""
    if kind is Any:
        return True, value
    if kind is bool:
        return isinstance(value, bool), value
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if kind is str:
        return isinstance(value, str), value
    if kind is type(None):
        return value is None, value
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        for arm in args:
            ok, out = _match(value, arm)
            if ok:
                return True, out
        return False, value
    if kind in (tuple, list) or origin in (tuple, list):
        if not isinstance(value, list | tuple):
            return False, value
        if args and args[-1] is not Ellipsis and origin is tuple:  # fixed arity, e.g. tuple[int, int]
            if len(args) != len(value):
                return False, value
            arms = args
        else:
            arms = [args[0] if args else Any] * len(value)
        items = [_match(v, a) for v, a in zip(value, arms, strict=True)]
        ok = all(ok for ok, _ in items)
        out = [v for _, v in items]
        return ok, (tuple(out) if tuple in (kind, origin) else out) if ok else value
    if kind in (dict, Mapping) or origin in (dict, Mapping):
        return isinstance(value, Mapping), value
    raise TypeError(f"no config rule for annotation {kind!r}")  # a schema bug, not a bad file


def check(value: Any, kind: Any, key: str, *, file: str = "config.json", example: Any = attrs.NOTHING,
          minimum: int | float | None = None, why: str = "") -> Any:
    """`value` of config key `key` if it has the shape `kind` (and is >= `minimum`); else a ConfigError naming it."""
    ok, out = _match(value, kind)
    if not ok:
        like = "" if example is attrs.NOTHING or example is None or kind is bool else f" like {_shown(example)}"
        raise ConfigError(f"{file}: key '{key}' must be {describe(kind)}{like}, got {_shown(value)}")
    if minimum is not None and out is not None and out < minimum:
        want = "a positive integer" if minimum == 1 and kind is int else f"at least {minimum}"
        raise ConfigError(f"{file}: key '{key}' must be {want}{f' ({why})' if why else ''}, got {_shown(out)}")
    return out


def section(cfg: Any, where: str, *, file: str = "config.json") -> Mapping[str, Any]:
    """`cfg` as a mapping (None = empty); anything else is a ConfigError naming the section."""
    if cfg is None:
        return {}
    if not isinstance(cfg, Mapping):
        what = f"key '{where}'" if where else "the top level"
        raise ConfigError(f"{file}: {what} must be an object, got {_shown(cfg)}")
    return cfg


def _resolved_fields(cls: type) -> tuple[attrs.Attribute, ...]:
    try:
        attrs.resolve_types(cls)  # string annotations (`from __future__ import annotations`) -> types, once
    except NameError as exc:
        raise TypeError(f"{cls.__name__}: an annotation cannot be resolved for config reading ({exc})") from None
    return tuple(f for f in attrs.fields(cls) if f.init)


def read_fields(cls: type, cfg: Any, where: str = "", *, file: str = "config.json", strict: bool = False,
                defaults: Mapping[str, Any] | None = None, **extra: Any) -> Any:
    """Build `cls` from the keys of `cfg` it declares, each checked; `extra` fields are the caller's, unchecked.

    `defaults` replace the class's defaults for absent keys; a callable one gets the values read so far
    (for sizes derived from others, e.g. `head_dim = hidden_size // num_attention_heads`).
    """
    data = section(cfg, where, file=file)
    fields = _resolved_fields(cls)
    keys = {f.name: f.metadata.get(_KEY) or f.name for f in fields}
    if strict:
        reject_unknown(data, keys.values(), file, shown=lambda k: dotted(where, k))
    defaults = defaults or {}
    values: dict[str, Any] = {}
    for f in fields:
        if f.name in extra:
            values[f.name] = extra[f.name]
            continue
        key, raw = dotted(where, keys[f.name]), data.get(keys[f.name])
        default = defaults.get(f.name, f.default)
        if isinstance(default, attrs.Factory):
            default = default.factory()  # config fields never take self
        if raw is None:
            if default is attrs.NOTHING:
                raise ConfigError(f"{file}: missing required key '{key}' ({describe(f.type)})")
            # a derived default is computed only when used: its checks (divisibility) concern the derivation
            values[f.name] = default(values) if callable(default) else default
        elif attrs.has(f.type):
            values[f.name] = read_fields(f.type, raw, key, file=file, strict=strict)
        else:
            values[f.name] = check(raw, f.type, key, file=file, example=None if callable(default) else default,
                                   minimum=f.metadata.get(_MIN), why=f.metadata.get(_WHY, ""))
    return cls(**values)


def merged_rope_keys(cfg: Mapping[str, Any], invalid: Callable[[str], Exception]) -> dict[str, Any]:
    """`rope_theta` (where the key is present) updated by `rope_scaling`, then `rope_parameters` (the published JSON's
    layout and transformers v5's), with `rope_type` (or the older `type`, default "default") set; a section that
    is neither an object nor null raises `invalid(key)`."""
    params: dict[str, Any] = {}
    if "rope_theta" in cfg:
        params["rope_theta"] = cfg["rope_theta"]
    for key in ("rope_scaling", "rope_parameters"):
        extra = cfg.get(key)
        if extra is None:
            continue
        if not isinstance(extra, Mapping):
            raise invalid(key)
        params.update(extra)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def rope_settings(cfg: Mapping[str, Any], where: str, default_theta: float,
                  kinds: tuple[str, ...] = ("default",)) -> dict[str, Any]:
    """The section's RoPE keys merged (`merged_rope_keys`: theta, mrope_section, ...), its `rope_type` one of `kinds`
    and its theta (`default_theta` where unset or null) checked."""
    params = merged_rope_keys(cfg, lambda key: ConfigError(f"config.json: '{where}.{key}' must be an object or null"))
    kind = params["rope_type"]
    if kind not in kinds:
        raise ConfigError(f"config.json: '{where}' rope_type {kind!r} is not supported (here: {list(kinds)})")
    if params.get("rope_theta") is None:
        params["rope_theta"] = default_theta
    params["rope_theta"] = check(params["rope_theta"], float, f"{where}.rope_theta", example=default_theta)
    return params


def head_dim_from_heads(values: Mapping[str, Any]) -> int:
    """A `read_fields` default for an absent `head_dim` (as in most published JSON): hidden_size / heads, from
    the (checked) values read so far."""
    return values["hidden_size"] // values["num_attention_heads"]


__all__ = ["check", "config_field", "describe", "dotted", "head_dim_from_heads", "merged_rope_keys", "read_fields", "rope_settings",
           "section"]
