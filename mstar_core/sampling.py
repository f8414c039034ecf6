"""`SamplingParams`: how an autoregressive node picks its next token (models and servers build it, engines apply it)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from mstar_core.errors import RequestError


def _ids(value: Iterable[int] | int | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _sequences(value: Iterable[Iterable[int]] | None) -> tuple[tuple[int, ...], ...]:
    if value is None:
        return ()
    return tuple(_ids(seq) for seq in value)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RequestError(f"sampling: {message}")


@attrs.frozen(kw_only=True)
class SamplingParams:
    """Per-request decoding rules. `temperature == 0` is greedy; `seed` makes sampling reproducible.

    `stop_token_ids` end generation when sampled (the stop token is returned with
    `finish_reason="stop"`); `stop_sequences` are token-id sequences matched against the generated
    tokens; `max_tokens` counts tokens sampled by the engine for one cache label. `logprobs=k`
    also returns the k most likely tokens with their log-probabilities (0 = only the chosen one).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_ids)
    stop_sequences: tuple[tuple[int, ...], ...] = attrs.field(default=(), converter=_sequences)
    seed: int | None = None
    logprobs: int | None = None

    def __attrs_post_init__(self) -> None:
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(0 <= self.min_p < 1, f"min_p must be in [0, 1), got {self.min_p}")
        _check(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _check(all(seq for seq in self.stop_sequences), "stop_sequences must not contain an empty sequence")
        _check(self.logprobs is None or self.logprobs >= 0, f"logprobs must be >= 0, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        """Whether the next token is the argmax (no randomness involved)."""
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> SamplingParams:
        """Build from a dict (e.g. request JSON); unknown keys raise `RequestError` listing the known ones."""
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise RequestError(f"sampling: unknown parameter(s) {unknown}; known: {sorted(known)}")
        try:
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise RequestError(f"sampling: {exc}") from None


GREEDY = SamplingParams()
