"""A transcription's audio bounded by what the model's context holds with the output it asks for (issue 50, item
4): the prompt's audio tokens plus the output budget fit, so audio that could never be answered is refused from its
header instead of failing after its decode ("sequence would reach 4097 tokens")."""

from __future__ import annotations

from types import SimpleNamespace

from mstar_core.api.media.limits import MediaLimits
from mstar_core.api.requests.transcription import PROMPT_RESERVE, audio_limits, output_budget


def test_audio_and_its_output_fit_the_context_together():
    adapter = SimpleNamespace(audio_tokens_per_second=13.0, context_tokens=4096)  # the tiny Qwen3-Omni's figures
    chat = MediaLimits(max_audio_seconds=310.0)  # chat's own bound: the audio alone fills the context
    seconds = audio_limits(adapter, chat).max_audio_seconds
    assert seconds < 300  # the 300 s FLAC is refused
    assert seconds * 13 + output_budget(seconds) + PROMPT_RESERVE <= 4096
    assert (seconds + 2) * 13 + output_budget(seconds + 2) + PROMPT_RESERVE > 4096  # and not much less is taken


def test_without_declared_figures_or_with_room_the_limits_stand():
    chat = MediaLimits(max_audio_seconds=30.0)
    assert audio_limits(SimpleNamespace(), chat) is chat
    assert audio_limits(SimpleNamespace(audio_tokens_per_second=13.0, context_tokens=65536), chat) is chat

