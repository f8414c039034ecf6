"""Declared request schemas: a model states its request fields once, the runtime checks them and documents them.

    SCHEMA = RequestSchema(
        fields=(
            RequestField("text", "string", "the text to speak", required=True, blank=False),
            RequestField("voice", "string", "speaker", default="tara", choices=VOICES),
            RequestField("max_tokens", "integer", "audio tokens to generate", default=1200, minimum=1, maximum=4096),
            *sampling_fields("temperature", "top_p", "seed", defaults={"temperature": 0.6}),
        ),
        example={"text": "Hello there!", "voice": "tara"},
    )

`LoadedModel(request_schema=SCHEMA)` makes `prepare_inputs` check a request against it before the model's
`prepare` runs: unknown fields (a 400 listing the known ones), missing required fields, types, bounds and
choices, each a `RequestError` naming the field in the same words on every model. `prepare` then receives
only known fields, converted, with the defaults filled in. `json_schema()` is what `/openapi.json` shows
for the model's inputs on `/v1/walks/{model}`; `example` is what the serve banner and `mstar run --help`
print, and a test sends to every model.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from mstar_core.errors import RequestError
from mstar_core.sampling import (
    MAX_SEED,
    SAMPLING_FIELDS,
    check_int,
    check_number,
    is_integer,
)

#: Field kinds and the JSON Schema type each is documented as.
KINDS = {
    "string": "string",
    "integer": "integer",
    "number": "number",
    "boolean": "boolean",
    "array": "array",
    "object": "object",
    "tensor": None,  # the native tensor object, or a (nested) list of numbers
    "any": None,
}

#: The native tensor format (`mstar_core.api.media.tensors`) as JSON Schema.
TENSOR_JSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "a tensor: raw little-endian bytes, base64, row-major",
    "properties": {
        "dtype": {"enum": ["float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8",
                           "bool"]},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 8},
        "data": {"type": "string", "format": "byte"},
    },
    "required": ["dtype", "shape", "data"],
    "additionalProperties": False,
}


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


#: A field without a default: absent from the prepared inputs when the request leaves it out.
UNSET: Any = _Unset()


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _choices(value: Any) -> tuple[Any, ...] | None:
    return None if value is None else tuple(value)


@attrs.frozen(kw_only=True)
class RequestField:
    """One request field: its kind, what it means, its default and bounds, and an optional extra check.

    `kind` is one of `KINDS`. `None` counts as "not sent" (JSON clients send explicit nulls): a
    `required` field then is missing, any other gets its `default` (or stays absent if it has none).
    Bounds: `minimum`/`maximum` for integers and numbers; `min_length`/`max_length` for strings
    (characters) and arrays (items); `blank=False` refuses whitespace-only strings; `choices` lists
    the accepted values; `items` is the kind of an array's elements (checked and documented).
    `check(value, name) -> value` runs last, on the converted value, for what bounds cannot say
    (token ids within the vocabulary, the shape of an image); it raises `RequestError(param=name)`.
    """

    name: str = attrs.field(kw_only=False)
    kind: str = attrs.field(default="any", kw_only=False)
    description: str = attrs.field(default="", kw_only=False)
    required: bool = False
    default: Any = UNSET
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    #: integers only: the value is a multiple of this (an image side on the latent grid)
    multiple_of: int | None = None
    min_length: int | None = None
    max_length: int | None = None
    blank: bool = True
    choices: tuple[Any, ...] | None = attrs.field(default=None, converter=_choices)
    items: str | None = None
    check: Callable[[Any, str], Any] | None = attrs.field(default=None, eq=False)
    #: extra JSON Schema keywords for the documentation (e.g. a pattern, an example)
    json_extra: Mapping[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"RequestField '{self.name}': unknown kind {self.kind!r}; kinds: {sorted(KINDS)}")
        if self.items is not None and self.items not in KINDS:
            raise ValueError(f"RequestField '{self.name}': unknown items kind {self.items!r}; kinds: {sorted(KINDS)}")
        if self.required and self.default is not UNSET:
            raise ValueError(f"RequestField '{self.name}': a required field has no default")
        if self.multiple_of is not None and (self.kind != "integer" or self.multiple_of < 1):
            raise ValueError(f"RequestField '{self.name}': multiple_of is a positive step of an integer field")
        if self.default is not UNSET and self.default is not None and (self.choices or self.multiple_of):
            self.convert(self.default)  # a default the field itself would refuse is the model's bug

    # -- checking ------------------------------------------------------------------------------

    def convert(self, value: Any) -> Any:
        """The checked (and converted) value; a `RequestError` naming the field otherwise."""
        value = _KIND_CHECKS[self.kind](self, value)
        if self.choices is not None and value not in self.choices:
            raise RequestError(f"unknown {self.name} {_show(value)}; choose one of "
                               f"{', '.join(str(c) for c in self.choices)}", param=self.name)
        if self.check is not None:
            value = self.check(value, self.name)
        return value

    def fail(self, message: str) -> RequestError:
        return RequestError(f"'{self.name}' {message}", param=self.name)

    # -- documentation -------------------------------------------------------------------------

    def json_schema(self) -> dict[str, Any]:
        """This field as JSON Schema (OpenAPI 3.1)."""
        out: dict[str, Any] = _kind_schema(self.kind)
        if self.kind == "array" and self.items is not None:
            out["items"] = _kind_schema(self.items)
        if self.description:
            out["description"] = self.description
        if self.default is not UNSET and _jsonable(self.default):
            out["default"] = self.default
        if self.minimum is not None:
            out["exclusiveMinimum" if self.exclusive_minimum else "minimum"] = self.minimum
        if self.maximum is not None:
            out["maximum"] = self.maximum
        if self.multiple_of is not None:
            out["multipleOf"] = self.multiple_of
        key = "Items" if self.kind == "array" else "Length"
        if self.min_length is not None:
            out[f"min{key}"] = self.min_length
        if self.max_length is not None:
            out[f"max{key}"] = self.max_length
        if self.choices is not None:
            out["enum"] = list(self.choices)
        out.update(self.json_extra)
        return out


def _kind_schema(kind: str) -> dict[str, Any]:
    if kind == "tensor":
        return {"anyOf": [{"$ref": "#/components/schemas/Tensor"}, {"type": "array"}, {"type": "number"}]}
    json_type = KINDS[kind]
    return {} if json_type is None else {"type": json_type}


def _jsonable(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool | list | dict)


def _string(field: RequestField, value: Any) -> str:
    lo, hi = field.min_length, field.max_length
    if not isinstance(value, str) or (not field.blank and not value.strip()) or (lo and len(value) < lo):
        needs = "a non-empty string" if (lo or not field.blank) else "a string"
        raise field.fail(f"must be {needs}" + (f" of at most {hi} characters" if hi is not None else "")
                         + f", got {_show(value)}")
    if hi is not None and len(value) > hi:
        raise field.fail(f"must be a string of at most {hi} characters, got {len(value)}")
    return value


def _bounds(field: RequestField) -> str:
    lo = "-inf" if field.minimum is None else f"{field.minimum:g}"
    hi = "inf" if field.maximum is None else f"{field.maximum:g}"
    return f"{'(' if field.exclusive_minimum or field.minimum is None else '['}{lo}, {hi}{']' if field.maximum is not None else ')'}"


def _integer(field: RequestField, value: Any) -> int:
    if field.minimum is None and field.maximum is None:
        if not is_integer(value):
            raise field.fail(f"must be an integer, got {_show(value)}")
        return int(value)
    lo = -(2**63) if field.minimum is None else int(field.minimum) + (1 if field.exclusive_minimum else 0)
    hi = MAX_SEED if field.maximum is None else int(field.maximum)
    number = check_int(value, field.name, lo, hi, bounds=f"[{lo}, 2**63 - 1]" if hi == MAX_SEED else None)
    if field.multiple_of is not None and number % field.multiple_of:
        raise field.fail(f"must be a multiple of {field.multiple_of} in [{lo}, {hi}], got {number}")
    return number


def _number(field: RequestField, value: Any) -> float:
    number = check_number(value, field.name)
    low_ok = field.minimum is None or (number > field.minimum if field.exclusive_minimum else number >= field.minimum)
    if not low_ok or (field.maximum is not None and number > field.maximum):
        raise field.fail(f"must be in {_bounds(field)}, got {value!r}")
    return number


def _boolean(field: RequestField, value: Any) -> bool:
    if not isinstance(value, bool):
        raise field.fail(f"must be true or false, got {_show(value)}")
    return value


def _array(field: RequestField, value: Any) -> list[Any]:
    what = f"list of {field.items}s" if field.items not in (None, "any") else "list"
    lo, hi = field.min_length, field.max_length
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Sequence) or (lo and len(value) < lo):
        raise field.fail(f"must be a {'non-empty ' if lo else ''}{what}, got {_show(value)}")
    if hi is not None and len(value) > hi:
        raise field.fail(f"must have at most {hi} items, got {len(value)}")
    if field.items is not None and field.items != "any":
        for i, item in enumerate(value):
            try:
                _KIND_CHECKS[field.items](RequestField(f"{field.name}[{i}]", field.items), item)
            except RequestError as exc:
                raise RequestError(str(exc), param=field.name) from None
    return list(value)


def _object(field: RequestField, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise field.fail(f"must be an object, got {_show(value)}")
    return value


def _tensor(field: RequestField, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, str | bytes | Mapping) or isinstance(value, bool):
        raise field.fail(f"must be a tensor ({{'dtype', 'shape', 'data'}}) or a list of numbers, got {_show(value)}")
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise field.fail("must be a tensor ({'dtype', 'shape', 'data'}) or a rectangular list of numbers") from None


_KIND_CHECKS: dict[str, Callable[[RequestField, Any], Any]] = {
    "string": _string,
    "integer": _integer,
    "number": _number,
    "boolean": _boolean,
    "array": _array,
    "object": _object,
    "tensor": _tensor,
    "any": lambda _field, value: value,
}


# -- sampling fields ------------------------------------------------------------------------------

def sampling_field(name: str, *, default: Any = UNSET, description: str | None = None) -> RequestField:
    """A `SamplingParams` field, checked by the rule `SamplingParams` itself applies (`mstar_core.sampling`).

    Pass the values on to `SamplingParams.from_mapping`; bounds that depend on the vocabulary (`top_k`,
    `logprobs`, token ids) stay with `SamplingParams.check_vocab`, and the id lists are checked when
    `SamplingParams` converts them.
    """
    if name not in SAMPLING_FIELDS:
        raise ValueError(f"sampling_field: unknown field {name!r}; known: {sorted(SAMPLING_FIELDS)}")
    spec = SAMPLING_FIELDS[name]
    return RequestField(name, "any", description or spec.doc, default=default, check=spec.check,
                        json_extra=dict(spec.json_schema))


def sampling_fields(*names: str, defaults: Mapping[str, Any] | None = None) -> tuple[RequestField, ...]:
    """`sampling_field` for each name, with `defaults` by name."""
    defaults = defaults or {}
    unknown = sorted(set(defaults) - set(names))
    if unknown:
        raise ValueError(f"sampling_fields: defaults for fields not listed: {unknown}")
    return tuple(sampling_field(n, default=defaults.get(n, UNSET)) for n in names)


# -- the schema -----------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class RequestSchema:
    """A model's request fields, checked before its `prepare` runs and shown in `/openapi.json`.

    `exactly_one_of` lists groups of fields of which a request sends exactly one (a prompt as
    `messages`, `prompt` or `input_ids`). `example` is a complete request in JSON form (tensors as
    `{"dtype", "shape", "data"}`) that the model answers with a 200: the serve banner prints it, and
    a test sends it. `allow_extra` passes unknown fields through instead of refusing them.
    `draws_n` says the model draws `n` outputs of one request itself (an integer field `n`: forks of
    one prefill, images sharing the prompt's cache); without it a route submits `n` requests.
    """

    fields: tuple[RequestField, ...] = attrs.field(converter=tuple)
    exactly_one_of: tuple[tuple[str, ...], ...] = attrs.field(default=(), converter=lambda v: tuple(map(tuple, v)))
    example: Mapping[str, Any] | None = None
    description: str = ""
    allow_extra: bool = False
    draws_n: bool = False

    def __attrs_post_init__(self) -> None:
        names = [f.name for f in self.fields]
        if self.draws_n and ("n" not in names or self.field("n").kind != "integer"):
            raise ValueError("RequestSchema: draws_n needs an integer field 'n' (how many outputs)")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"RequestSchema: duplicate fields {dupes}")
        for group in self.exactly_one_of:
            missing = [n for n in group if n not in names]
            if missing:
                raise ValueError(f"RequestSchema: exactly_one_of names undeclared fields {missing}")

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.fields]

    def field(self, name: str) -> RequestField:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"no field '{name}'; fields: {self.names}")

    def get(self, name: str) -> RequestField | None:
        """The field called `name`, or None (what a route asks before it offers a field)."""
        return next((f for f in self.fields if f.name == name), None)

    def validate(self, inputs: Any) -> dict[str, Any]:
        """The checked request: known fields only, converted, defaults filled in; else a `RequestError`."""
        if not isinstance(inputs, Mapping):
            raise RequestError(f"request inputs must be an object, got {type(inputs).__name__}")
        known = self.names
        unknown = [k for k in inputs if k not in known]
        out: dict[str, Any] = {} if not self.allow_extra else {k: inputs[k] for k in unknown}
        if unknown and not self.allow_extra:
            hints = [f"'{k}' -> '{m[0]}'" for k in map(str, unknown)
                     if (m := difflib.get_close_matches(k, known, n=1, cutoff=0.75))]
            hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
            raise RequestError(f"unknown field(s) {sorted(map(str, unknown))}{hint}; known fields: {known}",
                               param=str(unknown[0]))
        sent = {k for k in known if inputs.get(k) is not None}
        for group in self.exactly_one_of:
            given = [k for k in group if k in sent]
            if len(given) != 1:
                raise RequestError(f"send exactly one of {list(group)}, got {given or 'none'}",
                                   param=given[1] if len(given) > 1 else group[0])
        for field in self.fields:
            value = inputs.get(field.name)
            if value is None:
                if field.required:
                    what = f": {field.description}" if field.description else ""
                    raise RequestError(f"missing field '{field.name}'{what}", param=field.name)
                if field.default is not UNSET:
                    out[field.name] = field.default
                continue
            out[field.name] = field.convert(value)
        return out

    def json_schema(self) -> dict[str, Any]:
        """The request's inputs as JSON Schema (OpenAPI 3.1): what `/openapi.json` shows per model."""
        schema: dict[str, Any] = {
            "type": "object",
            "properties": {f.name: f.json_schema() for f in self.fields},
            "additionalProperties": self.allow_extra,
        }
        required = [f.name for f in self.fields if f.required]
        if required:
            schema["required"] = required
        if self.exactly_one_of:
            one_of = [{"oneOf": [{"required": [n]} for n in group]} for group in self.exactly_one_of]
            if len(one_of) == 1:
                schema.update(one_of[0])
            else:
                schema["allOf"] = one_of
        if self.description:
            schema["description"] = self.description
        if self.example is not None:
            schema["examples"] = [dict(self.example)]
        return schema
