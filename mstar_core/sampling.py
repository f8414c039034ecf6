"""`SamplingParams`: how an autoregressive node picks its next token (models and servers build it, engines apply it).

Every field is checked here, where a request is prepared, so a bad value becomes a `RequestError` (a 400 that
names the field) before it reaches an engine, where it could fail the whole batch it was decoded with.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from mstar_core.errors import RequestError
from mstar_core.grammar.spec import GrammarSpec, as_grammar
from mstar_core.strict import reject_unknown

#: Seeds are integers in [0, MAX_SEED]: what an int64 holds on every wire and what `torch.Generator.manual_seed`
#: takes without aliasing (torch would also take negatives and up to 2**64 - 1, mapping -1 to 2**64 - 1).
MAX_SEED = 2**63 - 1
#: The smallest non-zero temperature. Logits are divided by it in float32; far below 1e-5 the quotient of ordinary
#: logits overflows or the temperature itself rounds to 0, and sampling yields NaN. Send 0 for greedy decoding.
MIN_TEMPERATURE = 1e-5
#: The largest temperature (and repetition penalty): beyond float32's range it becomes inf, and a masked logit
#: (-inf) divided by inf is NaN. 1e5 already makes any distribution uniform.
MAX_SCALE = 1e5
#: Upper bound of integer lengths (`max_tokens`, `top_k`, `logprobs`); far above any vocabulary or context.
MAX_COUNT = 2**31 - 1
#: OpenAI's bounds: presence and frequency penalties in [-2, 2], a logit bias in [-100, 100].
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
#: The most log-probabilities returned per token on the OpenAI routes (`top_logprobs`, completions' `logprobs`).
MAX_TOP_LOGPROBS = 20


def choice_seed(seed: int | None, i: int) -> int | None:
    """Output `i`'s seed when a request seeded `seed` asks for several: `seed + i`, wrapping in [0, MAX_SEED].

    The one rule for every per-choice seed (chat and completions choices, a forked branch, the images of
    one request): output i of a request is what a single request seeded `seed + i` gives. None stays None.
    """
    return None if seed is None else (seed + i) % (MAX_SEED + 1)


def _fail(field: str, message: str) -> RequestError:
    return RequestError(f"'{field}' {message}", param=field)


def is_integer(value: Any) -> bool:
    """A JSON integer: `int` but not `bool` (`true` is an int in Python, never a count or a seed)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(value: Any, field: str, lo: int, hi: int, *, bounds: str | None = None) -> int:
    """`value` as an int in [lo, hi], else a RequestError naming `field` (1.5, "3", true and 3.0 are refused)."""
    if not is_integer(value) or not lo <= value <= hi:
        raise _fail(field, f"must be an integer in {bounds or f'[{lo}, {hi}]'}, got {_show(value)}")
    return int(value)


def check_seed(value: Any, field: str = "seed") -> int:
    """A seed: an integer in [0, MAX_SEED] (2**63 - 1)."""
    return check_int(value, field, 0, MAX_SEED, bounds="[0, 2**63 - 1]")


def check_number(value: Any, field: str) -> float:
    """A finite real number (an int or float, not a bool, not NaN or infinity)."""
    if not (is_integer(value) or isinstance(value, float)):
        raise _fail(field, f"must be a number, got {_show(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        raise _fail(field, f"must be a finite number, got {_show(value)}") from None
    if not math.isfinite(number):
        raise _fail(field, f"must be a finite number, got {value}")
    return number


def check_temperature(value: Any, field: str = "temperature") -> float:
    """0 (greedy) or a temperature in [MIN_TEMPERATURE, MAX_SCALE]."""
    temperature = check_number(value, field)
    if temperature != 0 and not MIN_TEMPERATURE <= temperature <= MAX_SCALE:
        raise _fail(field, f"must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_SCALE:g}], got {value!r}; smaller "
                           "temperatures overflow the arithmetic (send 0 for greedy decoding)")
    return temperature


def _in_range(value: Any, field: str, ok, bounds: str) -> float:
    number = check_number(value, field)
    if not ok(number):
        raise _fail(field, f"must be in {bounds}, got {value!r}")
    return number


def _token_id(value: Any, field: str) -> int:
    return check_int(value, field, 0, MAX_COUNT)


def _ids(value: Iterable[int] | int | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if is_integer(value):
        return (_token_id(value, "stop_token_ids"),)
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise _fail("stop_token_ids", f"must be a list of token ids, got {_show(value)}")
    return tuple(_token_id(v, "stop_token_ids") for v in value)


def _sequences(value: Iterable[Iterable[int]] | None) -> tuple[tuple[int, ...], ...]:
    if value is None:
        return ()
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise _fail("stop_sequences", f"must be a list of token-id lists, got {_show(value)}")
    sequences = []
    for seq in value:
        if is_integer(seq) or isinstance(seq, str | bytes | Mapping) or not isinstance(seq, Iterable):
            raise _fail("stop_sequences", f"must be a list of token-id lists, got an element {_show(seq)}")
        ids = tuple(_token_id(v, "stop_sequences") for v in seq)
        if not ids:
            raise _fail("stop_sequences", "must not contain an empty sequence")
        sequences.append(ids)
    return tuple(sequences)


def check_logit_bias(value: Any, field: str = "logit_bias") -> tuple[tuple[int, float], ...]:
    """`{token id: bias}` (ids as JSON object keys, so strings of digits; ints too; or a list of `[id, bias]` pairs)
    as sorted `(id, bias)` pairs.

    Each bias is a finite number in [-100, 100], added to the token's logit before sampling (-100 in effect bans
    the token, 100 all but forces it). Ids are checked against the vocabulary by `SamplingParams.check_vocab`.
    """
    if isinstance(value, list | tuple) and all(isinstance(p, list | tuple) and len(p) == 2 for p in value):
        # the normalised pairs (attrs.evolve, or after a trip over the wire as lists): checked again all the same
        if any(isinstance(p[0], list | tuple | Mapping) for p in value):
            raise _fail(field, f"keys must be token ids, got {_show(value)}")
        value = dict(value)
    if not isinstance(value, Mapping):
        raise _fail(field, f"must be an object mapping token ids to biases, got {_show(value)}")
    pairs: dict[int, float] = {}
    for key, bias in value.items():
        token = key
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10:
            token = int(key)
        if not is_integer(token) or not 0 <= token <= MAX_COUNT:
            raise _fail(field, f"keys must be token ids (non-negative integers as strings), got {_show(key)}")
        try:
            number = check_number(bias, field)
        except RequestError as exc:
            raise _fail(field, f"biases must be finite numbers, got {_show(bias)} for token {token}") from exc
        if not -MAX_LOGIT_BIAS <= number <= MAX_LOGIT_BIAS:
            raise _fail(field, f"biases must be in [-100, 100], got {_show(bias)} for token {token}")
        pairs[int(token)] = number
    return tuple(sorted(pairs.items()))


def _show(value: Any) -> str:
    """A short rendering of a rejected value (huge ints and long strings are cut)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@attrs.frozen
class SamplingField:
    """One sampling field, declared once: read by `SamplingParams` (its default and check), by request schemas
    (`mstar_core.schema.sampling_field`: its JSON Schema and doc), by the OpenAI routes (`openai`: the tighter
    bounds OpenAI documents, as pydantic `Field` keywords) and by adapters that forward sampling fields."""

    name: str
    doc: str
    #: the value as JSON Schema (the engine's bounds, what `check` enforces)
    json_schema: Mapping[str, Any]
    #: `check(value, field)` -> the value converted, or a RequestError naming `field`; None: `SamplingParams`
    #: converts it (token-id lists, the grammar)
    check: Callable[[Any, str], Any] | None = None
    #: OpenAI's bounds on its routes (pydantic keywords such as `ge`, `le`), None where it documents none
    openai: Mapping[str, Any] | None = None


#: The sampling fields (their defaults are `SamplingParams`' own, or a model's `SamplingDefaults`).
SAMPLING_FIELDS: dict[str, SamplingField] = {f.name: f for f in (
    SamplingField("temperature", "0 is greedy; otherwise in [1e-5, 1e5]",
                  {"type": "number", "minimum": 0, "maximum": MAX_SCALE}, check_temperature, {"ge": 0.0, "le": 2.0}),
    SamplingField("top_k", "keep the k most likely tokens (0: all)", {"type": "integer", "minimum": 0,
                                                                       "maximum": MAX_COUNT},
                  lambda v, f: check_int(v, f, 0, MAX_COUNT), {"ge": -1, "le": MAX_COUNT}),  # vLLM's -1 is 0
    SamplingField("top_p", "nucleus sampling: the probability mass kept",
                  {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                  lambda v, f: _in_range(v, f, lambda x: 0 < x <= 1, "(0, 1]"), {"gt": 0.0, "le": 1.0}),
    SamplingField("min_p", "drop tokens below min_p times the top token's probability",
                  {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
                  lambda v, f: _in_range(v, f, lambda x: 0 <= x < 1, "[0, 1)"), {"ge": 0.0, "lt": 1.0}),
    # logits are divided or multiplied by it, so it has the temperature's finite range (1 disables it)
    SamplingField("repetition_penalty", "divides positive logits of tokens already in the sequence (1: off)",
                  {"type": "number", "minimum": MIN_TEMPERATURE, "maximum": MAX_SCALE},
                  lambda v, f: _in_range(v, f, lambda x: MIN_TEMPERATURE <= x <= MAX_SCALE,
                                         f"[{MIN_TEMPERATURE:g}, {MAX_SCALE:g}]"), {"gt": 0.0}),
    SamplingField("presence_penalty", "subtracted once from the logit of each token generated so far",
                  {"type": "number", "minimum": -MAX_PENALTY, "maximum": MAX_PENALTY},
                  lambda v, f: _in_range(v, f, lambda x: -MAX_PENALTY <= x <= MAX_PENALTY, "[-2, 2]"),
                  {"ge": -MAX_PENALTY, "le": MAX_PENALTY}),
    SamplingField("frequency_penalty", "subtracted per occurrence among the generated tokens",
                  {"type": "number", "minimum": -MAX_PENALTY, "maximum": MAX_PENALTY},
                  lambda v, f: _in_range(v, f, lambda x: -MAX_PENALTY <= x <= MAX_PENALTY, "[-2, 2]"),
                  {"ge": -MAX_PENALTY, "le": MAX_PENALTY}),
    SamplingField("logit_bias", "token id -> bias added to its logit",
                  {"type": "object", "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS,
                                                              "maximum": MAX_LOGIT_BIAS}}, check_logit_bias),
    SamplingField("max_tokens", "the most tokens to generate", {"type": "integer", "minimum": 1, "maximum": MAX_COUNT},
                  lambda v, f: check_int(v, f, 1, MAX_COUNT), {"ge": 1, "le": 1_000_000}),
    SamplingField("seed", "makes sampling reproducible",
                  {"type": "integer", "minimum": 0, "maximum": MAX_SEED}, check_seed, {"ge": 0, "le": MAX_SEED}),
    SamplingField("logprobs", "return each token's log-probability and those of the k most likely tokens",
                  {"type": "integer", "minimum": 0, "maximum": MAX_COUNT}, lambda v, f: check_int(v, f, 0, MAX_COUNT)),
    SamplingField("stop_token_ids", "token ids that end generation",
                  {"type": "array", "items": {"type": "integer", "minimum": 0}}),
    SamplingField("stop_sequences", "token-id sequences that end generation",
                  {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0}}}),
    SamplingField("grammar", "[kind, source]: output constrained to a grammar (json_schema, json_object, "
                  "structural_tag, regex, ebnf); the OpenAI routes set it from response_format and tools",
                  {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 2}),
)}

#: One check per field, shared by `SamplingParams` and by the HTTP edge for the same names in any request.
FIELD_CHECKS = {name: f.check for name, f in SAMPLING_FIELDS.items() if f.check is not None}


def sampling_names(*only: str, without: Iterable[str] = ()) -> tuple[str, ...]:
    """Declared sampling field names: `only` those (each checked to be declared), else all of them in declaration
    order, less `without`. What a model or adapter forwards, named against the declaration, never by hand."""
    named = set(only) | set(without)
    unknown = sorted(named - set(SAMPLING_FIELDS))
    if unknown:
        raise ValueError(f"sampling_names: unknown fields {unknown}; known: {list(SAMPLING_FIELDS)}")
    chosen = only or tuple(SAMPLING_FIELDS)
    return tuple(name for name in chosen if name not in set(without))


def check_openai(name: str, value: Any, field: str | None = None) -> Any:
    """`value` of sampling field `name` within OpenAI's bounds for it (then the engine's), else a RequestError
    naming `field`; None passes (unset). For routes whose bodies are not pydantic models (forms, socket events)."""
    field = field or name
    if value is None:
        return None
    spec = SAMPLING_FIELDS[name]
    value = spec.check(value, field) if spec.check is not None else value
    bounds = spec.openai or {}
    ok = {"ge": lambda b: value >= b, "gt": lambda b: value > b, "le": lambda b: value <= b,
          "lt": lambda b: value < b}
    for key, bound in bounds.items():
        if not ok[key](bound):
            low = "(" if "gt" in bounds else "["
            high = ")" if "lt" in bounds else "]"
            lo = bounds.get("ge", bounds.get("gt", "-inf"))
            hi = bounds.get("le", bounds.get("lt", "inf"))
            raise _fail(field, f"must be in {low}{lo:g}, {hi:g}{high}, got {value!r}")
    return value


def fit_max_tokens(requested: int | None, prompt_tokens: int, context: int, default: int | None = None) -> int:
    """`max_tokens` fitted to the context: what a request asked for (or `default`, or `SamplingParams`' own),
    at most the room the prompt leaves. The one clamp (OpenAI's behaviour: the reply stops with finish_reason
    "length"), applied where a request is prepared; the engine only stops at the limit it is given."""
    wanted = requested if requested is not None else default if default is not None else _DEFAULT_MAX_TOKENS
    return max(1, min(wanted, context - prompt_tokens))


def check_fields(values: Mapping[str, Any], where: str = "") -> None:
    """Check the sampling-named fields of a request mapping (None means "not set"); the error names `where + field`."""
    for name, check in FIELD_CHECKS.items():
        value = values.get(name)
        if value is not None:
            check(value, where + name)


def _checked(name: str):
    check = FIELD_CHECKS[name]
    return lambda value: check(value, name)


def _optional(name: str):
    check = FIELD_CHECKS[name]
    return lambda value: None if value is None else check(value, name)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """Per-request decoding rules. `temperature == 0` is greedy; `seed` makes sampling reproducible.

    `stop_token_ids` end generation when sampled (the stop token is returned with
    `finish_reason="stop"`); `stop_sequences` are token-id sequences matched against the generated
    tokens; `max_tokens` counts tokens sampled by the engine for one cache label. `logprobs=k`
    also returns the k most likely tokens with their log-probabilities (0 = only the chosen one);
    log-probabilities are the model's, before any penalty, bias or sampling transform.

    Logit adjustments, applied in this order before temperature and the filters:
    `logit_bias` (`(token id, bias)` pairs) adds each bias to its token's logit; `repetition_penalty`
    divides positive and multiplies negative logits of every token in the sequence so far, prompt
    included (transformers' `RepetitionPenaltyLogitsProcessor`, the CTRL paper's rule); then
    `frequency_penalty * count + presence_penalty * (count > 0)` is subtracted, counting each token's
    occurrences among the *generated* tokens only (OpenAI's documented formula; vLLM counts the same).
    Bounds: temperature 0 or in [1e-5, 1e5]; repetition_penalty in [1e-5, 1e5]; presence and frequency
    penalties in [-2, 2]; biases in [-100, 100]; seed in [0, 2**63 - 1]; lengths are integers. Fields that
    depend on the vocabulary (`top_k`, `logprobs`, token ids) are checked by `check_vocab` at prepare time.
    """

    temperature: float = attrs.field(default=0.0, converter=_checked("temperature"))
    top_k: int = attrs.field(default=0, converter=_checked("top_k"))
    top_p: float = attrs.field(default=1.0, converter=_checked("top_p"))
    min_p: float = attrs.field(default=0.0, converter=_checked("min_p"))
    repetition_penalty: float = attrs.field(default=1.0, converter=_checked("repetition_penalty"))
    presence_penalty: float = attrs.field(default=0.0, converter=_checked("presence_penalty"))
    frequency_penalty: float = attrs.field(default=0.0, converter=_checked("frequency_penalty"))
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_checked("logit_bias"))
    max_tokens: int = attrs.field(default=256, converter=_checked("max_tokens"))
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_ids)
    stop_sequences: tuple[tuple[int, ...], ...] = attrs.field(default=(), converter=_sequences)
    seed: int | None = attrs.field(default=None, converter=_optional("seed"))
    logprobs: int | None = attrs.field(default=None, converter=_optional("logprobs"))
    #: Output constrained to a grammar (`mstar_core.grammar`): every sampled token keeps it matchable.
    grammar: GrammarSpec | None = attrs.field(default=None, converter=as_grammar)

    @property
    def greedy(self) -> bool:
        """Whether the next token is the argmax (no randomness involved)."""
        return self.temperature == 0.0 or self.top_k == 1

    def check_vocab(self, vocab_size: int) -> SamplingParams:
        """Refuse `top_k`, `logprobs`, stop and bias token ids beyond a vocabulary of `vocab_size`; return self."""
        if self.top_k > vocab_size:
            raise _fail("top_k", f"must be at most the vocabulary size {vocab_size} (0 disables it), got {self.top_k}")
        if self.logprobs is not None and self.logprobs > vocab_size:
            raise _fail("logprobs", f"must be at most the vocabulary size {vocab_size}, got {self.logprobs}")
        for field, ids in (("stop_token_ids", self.stop_token_ids),
                           ("stop_sequences", [t for seq in self.stop_sequences for t in seq]),
                           ("logit_bias", [t for t, _ in self.logit_bias])):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise _fail(field, f"has ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
        return self

    @property
    def adjusts_logits(self) -> bool:
        """Whether any penalty or bias changes the logits before sampling."""
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty
                    or self.logit_bias)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], defaults: SamplingDefaults | None = None) -> SamplingParams:
        """Build from a dict (e.g. request JSON) over a model's `defaults` (the one place they meet); unknown keys
        raise `RequestError` listing the known ones."""
        reject_unknown(values, (f.name for f in attrs.fields(cls)), "sampling", what="parameter", error=RequestError)
        return cls(**(defaults.merged(values) if defaults is not None else values))


GREEDY = SamplingParams()
_DEFAULT_MAX_TOKENS = attrs.fields(SamplingParams).max_tokens.default

#: generation_config.json's names for the sampling fields it may set (transformers' `GenerationConfig`)
_GENERATION_CONFIG = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                      "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@attrs.frozen
class SamplingDefaults:
    """A model's defaults for the sampling fields a request leaves unset (its checkpoint's, say): each checked by
    the field's declaration. `merged(fields)` is the one place a request's fields meet them: what the request set
    wins, then these, then `SamplingParams`' own defaults."""

    values: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)

    def __attrs_post_init__(self) -> None:
        for name, value in self.values.items():
            if name not in SAMPLING_FIELDS:
                raise ValueError(f"SamplingDefaults: unknown field {name!r}; known: {list(SAMPLING_FIELDS)}")
            check = SAMPLING_FIELDS[name].check
            if check is not None:
                check(value, name)

    def merged(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """The request's set fields (None means unset) over these defaults."""
        return {**self.values, **{k: v for k, v in fields.items() if v is not None}}

    def get(self, name: str, fallback: Any = None) -> Any:
        return self.values.get(name, fallback)

    @classmethod
    def from_generation_config(cls, config: Mapping[str, Any]) -> SamplingDefaults:
        """From a checkpoint's `generation_config.json`: its sampling fields under their names here; `do_sample:
        false` means greedy (temperature 0)."""
        values = {ours: config[theirs] for theirs, ours in _GENERATION_CONFIG.items() if config.get(theirs) is not None}
        if config.get("do_sample") is False:
            values["temperature"] = 0.0
        return cls(values)
