"""Checking a client's JSON schema before it compiles: a 400 naming the schema path of what is wrong or unsupported.

The grammar only enforces what it understands, so a keyword it would silently ignore (say `uniqueItems`) could let
through output the schema rejects: such keywords are refused by name rather than half honoured.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from mstar_core.errors import RequestError

#: Largest schema text accepted (bytes of its JSON) and deepest nesting: checked before any work.
MAX_SCHEMA_BYTES = 64 * 1024
MAX_DEPTH = 32

_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                "readOnly", "writeOnly", "$anchor"}
#: Keywords the grammar enforces (xgrammar's JSON-schema converter).
_SUPPORTED = {"type", "properties", "required", "additionalProperties", "items", "prefixItems", "enum", "const",
              "anyOf", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength",
              "pattern", "format", "minItems", "maxItems", "minProperties", "maxProperties", "$ref", "$defs",
              "definitions", "nullable"}
_FORMATS = {"date", "time", "date-time", "email", "uuid", "ipv4", "ipv6", "uri", "hostname", "duration"}
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "prefixItems")


def _path(where: str, parts: list[Any]) -> str:
    return where + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)


def check_json_schema(schema: Any, where: str) -> str:
    """`schema` checked (a valid JSON schema using only enforced keywords); returns its canonical JSON text.

    `where` is how the client names the schema (`response_format.json_schema.schema`); errors extend it.
    """
    if not isinstance(schema, Mapping) and not isinstance(schema, bool):
        raise RequestError(f"'{where}' must be a JSON schema object", param=where)
    text = json.dumps(schema, separators=(",", ":"))  # property order kept: the output follows it
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise RequestError(f"'{where}' is {len(text.encode())} bytes of JSON; at most {MAX_SCHEMA_BYTES} are accepted",
                           param=where)
    import jsonschema

    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        at = _path(where, list(exc.absolute_path))
        raise RequestError(f"'{at}' is not a valid JSON schema: {exc.message}", param=where) from None
    _walk(schema, where, [], 0)
    return text


def _walk(node: Any, where: str, parts: list[Any], depth: int) -> None:
    if isinstance(node, bool):
        return
    if depth > MAX_DEPTH:
        raise RequestError(f"'{_path(where, parts)}' nests deeper than {MAX_DEPTH} levels", param=where)
    if not isinstance(node, Mapping):
        raise RequestError(f"'{_path(where, parts)}' must be a schema object", param=where)
    unsupported = sorted(k for k in node if k not in _SUPPORTED and k not in _ANNOTATIONS and not k.startswith("x-"))
    if unsupported:
        raise RequestError(f"'{_path(where, parts)}' uses {', '.join(unsupported)}, which structured outputs do not "
                           f"enforce; supported keywords: {', '.join(sorted(_SUPPORTED))}", param=where)
    ref = node.get("$ref")
    if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
        raise RequestError(f"'{_path(where, [*parts, '$ref'])}' is {ref!r}: only references inside the schema "
                           "('#/$defs/...') are resolved", param=where)
    fmt = node.get("format")
    if fmt is not None and fmt not in _FORMATS:
        raise RequestError(f"'{_path(where, [*parts, 'format'])}' is {fmt!r}, which is not enforced; supported "
                           f"formats: {', '.join(sorted(_FORMATS))}", param=where)
    for key in _SCHEMA_MAPS:
        for name, sub in (node.get(key) or {}).items():
            _walk(sub, where, [*parts, key, name], depth + 1)
    for key in _SCHEMA_LISTS:
        for i, sub in enumerate(node.get(key) or ()):
            _walk(sub, where, [*parts, key, i], depth + 1)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), Mapping):
            _walk(node[key], where, [*parts, key], depth + 1)
