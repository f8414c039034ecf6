"""What a transcription may ask of a model: output in proportion to its audio (speech runs about 3 words a second,
a few tokens each), and so audio no longer than the model's context can hold together with that output."""

from __future__ import annotations

from typing import Any

import attrs

from mstar_core.api.media.limits import MediaLimits

#: Output tokens a second of speech may need, and the fixed part of the budget.
TOKENS_PER_SECOND, TOKENS_FIXED = 12, 32
#: Prompt tokens beside the audio: the chat template's turns and the instruction.
PROMPT_RESERVE = 128


def output_budget(seconds: float) -> int:
    """max_tokens for `seconds` of audio."""
    return int(min(4096, TOKENS_FIXED + TOKENS_PER_SECOND * seconds))


def audio_limits(adapter: Any, limits: MediaLimits) -> MediaLimits:
    """`limits` with max_audio_seconds lowered so that the audio's prompt tokens and its output budget fit the
    model's context together (when the adapter declares its audio rate and context; else `limits` as they are)."""
    rate, context = getattr(adapter, "audio_tokens_per_second", None), getattr(adapter, "context_tokens", None)
    if not rate or not context:
        return limits
    seconds = (context - PROMPT_RESERVE - TOKENS_FIXED) / (rate + TOKENS_PER_SECOND)
    if seconds >= limits.max_audio_seconds:
        return limits
    return attrs.evolve(limits, max_audio_seconds=float(max(1, int(seconds))))
