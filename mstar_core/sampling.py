"""`SamplingParams`: how an autoregressive node picks its next token (models and servers build it, engines apply it).

Every field is checked here, where a request is prepared, so a bad value becomes a `RequestError` (a 400 that
names the field) before it reaches an engine, where it could fail the whole batch it was decoded with.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
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


#: One check per field, shared by `SamplingParams` and by the HTTP edge for the same names in any request.
FIELD_CHECKS = {
    "temperature": check_temperature,
    "top_k": lambda v, f: check_int(v, f, 0, MAX_COUNT),
    "top_p": lambda v, f: _in_range(v, f, lambda x: 0 < x <= 1, "(0, 1]"),
    "min_p": lambda v, f: _in_range(v, f, lambda x: 0 <= x < 1, "[0, 1)"),
    # logits are divided or multiplied by it, so it has the temperature's finite range (1 disables it)
    "repetition_penalty": lambda v, f: _in_range(v, f, lambda x: MIN_TEMPERATURE <= x <= MAX_SCALE,
                                                 f"[{MIN_TEMPERATURE:g}, {MAX_SCALE:g}]"),
    "presence_penalty": lambda v, f: _in_range(v, f, lambda x: -MAX_PENALTY <= x <= MAX_PENALTY, "[-2, 2]"),
    "frequency_penalty": lambda v, f: _in_range(v, f, lambda x: -MAX_PENALTY <= x <= MAX_PENALTY, "[-2, 2]"),
    "logit_bias": check_logit_bias,
    "max_tokens": lambda v, f: check_int(v, f, 1, MAX_COUNT),
    "seed": check_seed,
    "logprobs": lambda v, f: check_int(v, f, 0, MAX_COUNT),
}


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
    def from_mapping(cls, values: Mapping[str, Any]) -> SamplingParams:
        """Build from a dict (e.g. request JSON); unknown keys raise `RequestError` listing the known ones."""
        reject_unknown(values, (f.name for f in attrs.fields(cls)), "sampling", what="parameter", error=RequestError)
        return cls(**values)


GREEDY = SamplingParams()
