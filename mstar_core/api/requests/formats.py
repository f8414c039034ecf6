"""`response_format` (json_object, json_schema) as a sampling grammar, checked and compiled before submission."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from mstar_core.api.http.errors import ApiError, from_request_error
from mstar_core.errors import RequestError
from mstar_core.grammar.check import check_json_schema
from mstar_core.grammar.compile import compile_bounded
from mstar_core.grammar.spec import GrammarSpec

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def response_format_grammar(fmt: Mapping[str, Any] | BaseModel | None, where: str = "response_format") -> GrammarSpec | None:
    """The grammar a `response_format` asks for (None for text); a 400 naming the field (and schema path) to fix.

    A request body's model is dumped here, in the caller's thread: a schema of a few thousand properties takes ~10 ms
    to dump, which the routes keep off the event loop with the rest of this work.

    `json_schema` takes OpenAI's `{name, schema, strict?, description?}`; `strict` is accepted either way: the
    output always follows the schema exactly (only its declared properties, every required one).
    """
    if fmt is None:
        return None
    if isinstance(fmt, BaseModel):
        fmt = fmt.model_dump()
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind != "json_schema":
        raise ApiError(400, f"'{where}.type' is {kind!r}; use text, json_object or json_schema", param=f"{where}.type")
    spec = fmt.get("json_schema")
    if not isinstance(spec, Mapping):
        raise ApiError(400, f"'{where}.json_schema' must be an object {{name, schema, strict?}}",
                       param=f"{where}.json_schema")
    name = spec.get("name")
    if name is not None and (not isinstance(name, str) or not _NAME.match(name)):
        raise ApiError(400, f"'{where}.json_schema.name' must be 1 to 64 letters, digits, _ or -",
                       param=f"{where}.json_schema.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ApiError(400, f"'{where}.json_schema.strict' must be a boolean", param=f"{where}.json_schema.strict")
    if "schema" not in spec:
        raise ApiError(400, f"'{where}.json_schema.schema' is missing: the JSON schema the output must follow",
                       param=f"{where}.json_schema.schema")
    try:
        return GrammarSpec("json_schema", check_json_schema(spec["schema"], f"{where}.json_schema.schema"))
    except RequestError as exc:
        raise from_request_error(exc) from None


def grammar_vocab(adapter: Any) -> Any:
    """The vocabulary the adapter's model compiles grammars against (`extras["grammar_vocab"]`), or None."""
    return (getattr(getattr(adapter, "loaded", None), "extras", None) or {}).get("grammar_vocab")


async def prepared_grammar(adapter: Any, model: str, spec: GrammarSpec | None, param: str) -> list[str] | None:
    """`spec` compiled for the model (off the event loop, bounded in time) as the `grammar` input, or None."""
    if spec is None:
        return None
    vocab = grammar_vocab(adapter)
    if vocab is None:
        raise ApiError(400, f"model '{model}' does not decode under a grammar, so '{param}' cannot be honoured; "
                            "leave it out", param=param)
    try:
        await compile_bounded(vocab, spec, param=param)
    except RequestError as exc:
        raise from_request_error(exc) from None
    return [spec.kind, spec.source]
