"""What a grammar may cost, set by the operator (environment variables, read when used so tests and `mstar serve`
can set them): the size and shape a schema may have before any work is done on it, and the compile pool's bounds.

Each limit is checked before the work it protects: schema size and nesting before the schema is parsed by anything
recursive, the grammar's size before it is queued, the queue's length before a compile waits, and the compile's
time while it runs (its process is killed past it).
"""

from __future__ import annotations

import os

from mstar_core.strict import positive_number


def _number(name: str, default: float) -> float:
    """The environment variable `name` as a positive number (`mstar_core.strict`'s rule: a ConfigError naming it),
    or `default` when unset or blank."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    return float(positive_number(raw, f"environment variable {name}"))


def max_schema_bytes() -> int:
    """Bytes of one schema's JSON (a response format, or one tool's parameters): MSTAR_GRAMMAR_MAX_SCHEMA_BYTES."""
    return int(_number("MSTAR_GRAMMAR_MAX_SCHEMA_BYTES", 64 * 1024))


def max_grammar_bytes() -> int:
    """Bytes of a whole grammar's source (all of a request's tools together): MSTAR_GRAMMAR_MAX_BYTES."""
    return int(_number("MSTAR_GRAMMAR_MAX_BYTES", 256 * 1024))


def max_properties() -> int:
    """Properties declared in one schema, all objects together: MSTAR_GRAMMAR_MAX_PROPERTIES (OpenAI's limit)."""
    return int(_number("MSTAR_GRAMMAR_MAX_PROPERTIES", 5000))


def compile_timeout_s() -> float:
    """Seconds one compile may run before its process is killed and the request refused (a 400):
    MSTAR_GRAMMAR_COMPILE_TIMEOUT."""
    return _number("MSTAR_GRAMMAR_COMPILE_TIMEOUT", 10.0)


def compile_memory_mb() -> int:
    """Resident memory (MB) one compile process may reach before it is killed and the request refused (a 400):
    MSTAR_GRAMMAR_COMPILE_MEMORY_MB. It counts the pages it shares with the zygote (xgrammar, torch) as well."""
    return int(_number("MSTAR_GRAMMAR_COMPILE_MEMORY_MB", 2048))


def compile_workers() -> int:
    """Compile processes at once: MSTAR_GRAMMAR_WORKERS (more only share the same cores and all miss the limit)."""
    return int(_number("MSTAR_GRAMMAR_WORKERS", 2))


def compile_queue() -> int:
    """Compiles waiting for a process, beyond those running; one more is a 503: MSTAR_GRAMMAR_QUEUE."""
    return int(_number("MSTAR_GRAMMAR_QUEUE", 8))


#: Nesting of schema objects (properties, items, anyOf, ...) a schema may have.
MAX_DEPTH = 32
#: Nesting of JSON containers of any kind (a schema level is at most two: `properties` -> name -> schema), with room
#: for enum / const values; checked first, without recursion, so nothing after it can run out of stack.
MAX_JSON_DEPTH = 2 * MAX_DEPTH + 8
#: Nested groups in a `pattern` (Python's and xgrammar's regex parsers both recurse per group).
MAX_PATTERN_DEPTH = 32
