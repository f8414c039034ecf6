"""`GrammarSpec`: what a request's output must match, as (kind, source) strings that any wire carries."""

from __future__ import annotations

import hashlib
from typing import Any

import attrs

from mstar_core.errors import RequestError

#: json_schema: source is a JSON schema's text; json_object: any JSON object (source empty); structural_tag:
#: xgrammar's structural-tag JSON (tool calls: free text with tagged, schema-checked calls); regex; ebnf.
GRAMMAR_KINDS = ("json_schema", "json_object", "structural_tag", "regex", "ebnf")


@attrs.frozen
class GrammarSpec:
    """A grammar by kind and source text; `digest` names it in compile caches."""

    kind: str
    source: str = ""

    @property
    def digest(self) -> str:
        return hashlib.blake2b(f"{self.kind}\0{self.source}".encode(), digest_size=16).hexdigest()


def as_grammar(value: Any) -> GrammarSpec | None:
    """`SamplingParams.grammar`'s converter: a spec, a `[kind, source]` pair (as the wire carries it), or None."""
    if value is None or isinstance(value, GrammarSpec):
        return value
    if isinstance(value, list | tuple) and len(value) == 2 and all(isinstance(v, str) for v in value):
        kind, source = value
    elif isinstance(value, dict) and isinstance(value.get("kind"), str) and isinstance(value.get("source", ""), str):
        kind, source = value["kind"], value.get("source", "")
    else:
        raise RequestError("'grammar' must be [kind, source] strings (or {kind, source})", param="grammar")
    if kind not in GRAMMAR_KINDS:
        raise RequestError(f"'grammar' kind {kind!r} is unknown; use one of {list(GRAMMAR_KINDS)}", param="grammar")
    return GrammarSpec(kind, source)
