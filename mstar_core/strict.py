"""The one strict-keys check of every config file, settings mapping and request dict (an unknown key names itself),
and the one reading of an operator's positive number (an environment variable's value)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from mstar_core.errors import ConfigError


def reject_unknown(given: Iterable[Any], known: Iterable[Any], where: str, *, what: str = "key",
                   error: Callable[..., Exception] = ConfigError, shown: Callable[[Any], Any] | None = None,
                   **error_kw: Any) -> None:
    """Raise `error("{where}: unknown {what}(s) [...]; known: [...]")` if `given` holds a name outside `known`.

    `shown` renders an unknown name (a dotted path, say); `error_kw` go to the error (`param=` of a
    `RequestError` is the first unknown name unless given).
    """
    allowed = set(known)
    unknown = sorted((k for k in given if k not in allowed), key=str)
    if not unknown:
        return
    names = [shown(k) for k in unknown] if shown else unknown
    prefix = f"{where}: " if where else ""
    raise error(f"{prefix}unknown {what}(s) {names}; known: {sorted(allowed, key=str)}", **error_kw)


def positive_number(raw: str, where: str, kind: type = float) -> int | float:
    """`raw` (an environment variable's value, say) as a positive `kind` (int or float); a ConfigError naming
    `where` otherwise."""
    try:
        value = kind(raw)
    except ValueError:
        raise ConfigError(f"{where} must be a number, got {raw!r}") from None
    if value <= 0:
        raise ConfigError(f"{where} must be positive, got {raw!r}")
    return value
