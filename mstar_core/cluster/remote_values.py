"""Structured runtime values (chunks, sampling parameters) as plain wire values, explicitly.

Only the types listed here cross a process boundary besides plain values and tensors; each is
rebuilt field by field from its own tag, so nothing on the wire can name a class to construct.
"""

from __future__ import annotations

from typing import Any

import attrs

from mstar_core.errors import RequestError
from mstar_core.streaming.policies import Chunk
from mstar_core.wire.errors import WireError

TYPE_KEY = "__mstar_type__"


def _structured_types() -> dict[str, type]:
    types: dict[str, type] = {"chunk": Chunk}
    try:
        from mstar_core.grammar.spec import GrammarSpec
        from mstar_core.sampling import SamplingParams

        types["sampling"] = SamplingParams
        types["grammar"] = GrammarSpec  # a sampling's `grammar` (structured outputs, tool calls)
    except ImportError:  # pragma: no cover - sampling ships with the core
        pass
    return types


_TYPES = _structured_types()
_TAGS = {cls: tag for tag, cls in _TYPES.items()}


def to_wire(value: Any) -> Any:
    """Replace structured values (recursively) by tagged dicts the wire codec can carry."""
    tag = _TAGS.get(type(value))
    if tag is not None:
        fields = {f.name: to_wire(getattr(value, f.name)) for f in attrs.fields(type(value))}
        return {TYPE_KEY: tag, "fields": fields}
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_wire(v) for v in value]
    return value


def from_wire(value: Any) -> Any:
    """Inverse of `to_wire`; unknown tags are a WireError, never a guess."""
    if isinstance(value, dict):
        if TYPE_KEY in value:
            tag = value[TYPE_KEY]
            cls = _TYPES.get(tag)
            if cls is None or set(value) != {TYPE_KEY, "fields"} or not isinstance(value["fields"], dict):
                raise WireError(f"unknown or malformed structured value {tag!r}; known: {sorted(_TYPES)}")
            fields = {k: from_wire(v) for k, v in value["fields"].items()}
            names = {f.name for f in attrs.fields(cls)}
            if set(fields) - names:
                raise WireError(f"structured value '{tag}' has unknown fields {sorted(set(fields) - names)}")
            if cls is Chunk:
                fields["items"] = tuple(fields["items"])
            try:
                return cls(**fields)
            except (TypeError, ValueError) as exc:
                raise WireError(f"structured value '{tag}' is invalid: {exc}") from None
        return {k: from_wire(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_wire(v) for v in value]
    return value


def error_fields(exc: BaseException) -> dict[str, Any]:
    """How a failure travels back: the underlying cause's type and message, and a request error's status and param.

    A `RequestError` (an engine rejecting the request's inputs: 400, 413, ...) keeps its status and
    the field it names, so the client sees the same 4xx as with the node in the serving process;
    anything else is a 500 (no status: the serving process reports it as the node's failure).
    """
    cause = getattr(exc, "cause", None) or exc
    status = getattr(exc, "status", None) if isinstance(exc, RequestError) else None
    param = getattr(exc, "param", None) if isinstance(exc, RequestError) else None
    if isinstance(cause, RequestError):
        status, param = cause.status, cause.param
    status = status if type(status) is int and 400 <= status <= 599 and status != 500 else None
    return {"error": str(cause), "error_type": type(cause).__name__, "error_status": status,
            "error_param": param if status is not None and type(param) is str else None}

