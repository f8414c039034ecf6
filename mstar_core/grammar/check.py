"""Checking a client's JSON schema before it compiles: a 400 naming the schema path of what is wrong or unsupported.

The grammar only enforces what it understands, so a keyword it would silently ignore (say `uniqueItems`) could let
through output the schema rejects: such keywords are refused by name rather than half honoured.

The schema's size, nesting and patterns are measured first by loops over an explicit stack (a request can nest as
deep as it likes, and any recursive checker, `re`'s included, would otherwise run out of stack: a 500); then each
schema object's keywords and their values are checked in one more such loop. jsonschema's own metaschema check is
not used: it recurses, and it takes seconds on the event loop for a schema of a thousand properties (Draft 2020-12's
dynamic references), where this check of the few keywords the grammar enforces takes milliseconds.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from mstar_core.errors import RequestError
from mstar_core.grammar import limits

MAX_DEPTH = limits.MAX_DEPTH

_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                "readOnly", "writeOnly", "$anchor"}
#: Keywords the grammar enforces (xgrammar's JSON-schema converter).
_SUPPORTED = {"type", "properties", "required", "additionalProperties", "items", "prefixItems", "enum", "const",
              "anyOf", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength",
              "pattern", "format", "minItems", "maxItems", "minProperties", "maxProperties", "$ref", "$defs",
              "definitions", "nullable"}
_KNOWN = _SUPPORTED | _ANNOTATIONS
_FORMATS = {"date", "time", "date-time", "email", "uuid", "ipv4", "ipv6", "uri", "hostname", "duration"}
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "prefixItems")


def _path(where: str, parts: tuple[Any, ...] | list[Any]) -> str:
    return where + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)


def check_json_schema(schema: Any, where: str) -> str:
    """`schema` checked (a valid JSON schema using only enforced keywords); returns its canonical JSON text.

    `where` is how the client names the schema (`response_format.json_schema.schema`); errors extend it.
    """
    if isinstance(schema, Mapping) and not isinstance(schema, dict):
        schema = dict(schema)  # (parsed JSON is dicts and lists: the checks below look for those)
    if not isinstance(schema, dict | bool):
        raise RequestError(f"'{where}' must be a JSON schema object", param=where)
    _measure(schema, where)  # bounded nesting from here on: json.dumps and jsonschema recurse
    text = json.dumps(schema, separators=(",", ":"))  # property order kept: the output follows it
    size, most = len(text.encode()), limits.max_schema_bytes()
    if size > most:
        raise RequestError(f"'{where}' is {size} bytes of JSON; at most {most} are accepted", param=where)
    _walk(schema, where)
    return text


def _measure(schema: Any, where: str) -> None:
    """Nesting of JSON containers, the number of declared properties and each `pattern`'s group nesting, all
    bounded; one pass over an explicit stack (no recursion a request can drive), stopping at the first excess."""
    most_properties = limits.max_properties()
    properties = 0
    stack: list[tuple[Any, int, tuple[Any, ...]]] = [(schema, 1, ())]
    while stack:
        node, depth, parts = stack.pop()
        if depth > limits.MAX_JSON_DEPTH:
            raise RequestError(f"'{_path(where, parts)}' nests deeper than {limits.MAX_JSON_DEPTH} levels of JSON "
                               f"(schemas may nest {MAX_DEPTH} levels)", param=where)
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                properties += len(props)
                if properties > most_properties:
                    raise RequestError(f"'{where}' declares more than {most_properties} properties",
                                       param=where)
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                _check_pattern(pattern, where, (*parts, "pattern"))
            stack.extend((v, depth + 1, (*parts, str(k))) for k, v in node.items() if isinstance(v, dict | list))
        elif isinstance(node, list):
            stack.extend((v, depth + 1, (*parts, i)) for i, v in enumerate(node) if isinstance(v, dict | list))


def _check_pattern(pattern: str, where: str, parts: tuple[Any, ...]) -> None:
    """A regex's group nesting, counted without parsing it (escapes and character classes skipped)."""
    depth = deepest = 0
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern.startswith("]", i + 1) or pattern.startswith("^]", i + 1):  # a leading ] is a literal
                i += 2 if pattern[i + 1] == "]" else 3
                continue
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth = max(0, depth - 1)
        i += 1
    if deepest > limits.MAX_PATTERN_DEPTH:
        raise RequestError(f"'{_path(where, parts)}' nests {deepest} groups deep; at most "
                           f"{limits.MAX_PATTERN_DEPTH} are accepted", param=where)


_TYPES = {"string", "number", "integer", "boolean", "object", "array", "null"}
_COUNTS = {"minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"}
_NUMBERS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
_STRINGS = {"title", "description", "$comment", "$id", "$schema", "$anchor", "$ref", "format"}
_BOOLS = {"deprecated", "readOnly", "writeOnly", "nullable"}


def _is_schema(value: Any) -> bool:
    return isinstance(value, bool | dict)


def _bad_value(key: str, value: Any) -> str | None:
    """What is wrong with a keyword's value (the metaschema's rules for the keywords enforced), or None."""
    if key == "type":
        names = value if isinstance(value, list) else [value]
        if not names or not all(isinstance(n, str) and n in _TYPES for n in names):
            return f"is not one of {sorted(_TYPES)} (or a list of them)"
        if len(set(names)) != len(names):
            return "has repeated types"
    elif key in _COUNTS:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return "is not a non-negative integer"
    elif key in _NUMBERS:
        if not isinstance(value, int | float) or isinstance(value, bool):
            return "is not a number"
    elif key in _STRINGS or key == "pattern":
        if not isinstance(value, str):
            return "is not a string"
        if key == "pattern":
            import re

            try:
                re.compile(value)
            except re.error as exc:
                return f"is not a regular expression ({exc})"
    elif key in _BOOLS:
        if not isinstance(value, bool):
            return "is not a boolean"
    elif key in ("properties", "$defs", "definitions"):
        if not isinstance(value, dict) or not all(_is_schema(v) for v in value.values()):
            return "is not an object of schemas"
    elif key in ("anyOf", "prefixItems"):
        if not isinstance(value, list) or (key == "anyOf" and not value) or not all(_is_schema(v) for v in value):
            return "is not a " + ("non-empty " if key == "anyOf" else "") + "list of schemas"
    elif key in ("items", "additionalProperties"):
        if not _is_schema(value):
            return "is not a schema (an object or a boolean)"
    elif key == "required":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            return "is not a list of property names"
        if len(set(value)) != len(value):
            return "has repeated names"
    elif key in ("enum", "examples"):
        if not isinstance(value, list):
            return "is not a list"
    return None


def _walk(schema: Any, where: str) -> None:
    """Every schema object's keywords enforced and its nesting within `MAX_DEPTH` (an explicit stack)."""
    stack: list[tuple[Any, tuple[Any, ...], int]] = [(schema, (), 0)]
    while stack:
        node, parts, depth = stack.pop()
        if isinstance(node, bool):
            continue
        if depth > MAX_DEPTH:
            raise RequestError(f"'{_path(where, parts)}' nests deeper than {MAX_DEPTH} levels", param=where)
        if not isinstance(node, dict):
            raise RequestError(f"'{_path(where, parts)}' must be a schema object", param=where)
        unsupported = [] if node.keys() <= _KNOWN else sorted(k for k in node if k not in _KNOWN
                                                              and not k.startswith("x-"))
        if unsupported:
            raise RequestError(f"'{_path(where, parts)}' uses {', '.join(unsupported)}, which structured outputs "
                               f"do not enforce; supported keywords: {', '.join(sorted(_SUPPORTED))}", param=where)
        ref = node.get("$ref")
        if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
            raise RequestError(f"'{_path(where, [*parts, '$ref'])}' is {ref!r}: only references inside the schema "
                               "('#/$defs/...') are resolved", param=where)
        for key, value in node.items():
            problem = _bad_value(key, value)
            if problem:
                raise RequestError(f"'{_path(where, [*parts, key])}' is not a valid JSON schema: {value!r:.80} "
                                   f"{problem}", param=where)
        fmt = node.get("format")
        if fmt is not None and fmt not in _FORMATS:
            raise RequestError(f"'{_path(where, [*parts, 'format'])}' is {fmt!r}, which is not enforced; supported "
                               f"formats: {', '.join(sorted(_FORMATS))}", param=where)
        children: list[tuple[Any, tuple[Any, ...], int]] = []
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                children += [(sub, (*parts, key, name), depth + 1) for name, sub in node[key].items()]
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                children += [(sub, (*parts, key, i), depth + 1) for i, sub in enumerate(node[key])]
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                children.append((node[key], (*parts, key), depth + 1))
        stack.extend(reversed(children))  # first child first: the error names what a recursive walk would
