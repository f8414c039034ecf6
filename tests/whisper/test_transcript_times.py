"""The transcription adapter's times: segments and words never pass the audio's end (a window's timestamp tokens may
name any time in its 30 seconds), words come offset by their window and only when asked."""

from __future__ import annotations

import pytest
import torch
from mstar_whisper.adapter import WhisperAudioAdapter
from mstar_whisper.config import WhisperTokens
from mstar_whisper.preset import build_tokenizer, generation_config


@pytest.fixture(scope="module")
def adapter():
    adapter = WhisperAudioAdapter.__new__(WhisperAudioAdapter)  # (bound by hand: no model behind it)
    adapter.tokenizer, adapter.tokens = build_tokenizer(), WhisperTokens.from_generation_config(generation_config())
    adapter.code_of = {v: k for k, v in adapter.tokens.languages.items()}
    return adapter


def _ts(adapter, seconds):
    return adapter.tokens.timestamp_begin + round(seconds / 0.02)


def test_a_short_window_segment_ends_at_the_audio_end(adapter):
    hello = adapter.tokenizer.encode(" hello world").ids
    tokens = [_ts(adapter, 0.0), *hello, _ts(adapter, 29.98), adapter.tokens.eot]
    env = {"no_speech": torch.tensor([0.1]), "language_token": 50259}
    part = adapter.transcript(tokens, [-0.1] * len(tokens), env, 30.0, 3.0, 0.0)
    assert [(s.start, s.end) for s in part.segments] == [(30.0, 33.0)]
    assert part.words is None  # not asked


def test_long_form_segments_and_words_are_clamped_and_offset(adapter):
    hello, world = adapter.tokenizer.encode(" hello").ids, adapter.tokenizer.encode(" world").ids
    text = [*hello, *world]
    times = [(t, 0.1 * k, 0.1 * (k + 1)) for k, t in enumerate(text)]
    times[-1] = (text[-1], times[-1][1], 29.6)  # aligned past the next window's seek (29.5 s): ends there
    late = [(t, 14.5 + 0.5 * k, 15.0 + 0.5 * k) for k, t in enumerate(text)]  # past the clip's 45 s at 29.5 s in
    env = {"no_speech": torch.tensor([0.1]), "language_token": 50259, "word_timestamps": True,
           "windows": [{"offset": 0.0, "segments": ((0.0, 20.0, tuple(text)),)},
                       {"offset": 29.5, "segments": ((44.0, 59.02, tuple(text)),)}],
           "window_token_times": [times, late]}
    out = adapter.long_transcript([-0.2], env, 45.0, 0.0)
    assert [(s.start, s.end) for s in out.segments] == [(0.0, 20.0), (44.0, 45.0)]
    words = [(w.word, round(w.start, 2), round(w.end, 2)) for w in out.words]
    n = len(hello)
    assert words == [("hello", 0.0, round(0.1 * n, 2)), ("world", round(0.1 * n, 2), 29.5),
                     ("hello", 44.0, min(44.5 + 0.5 * (n - 1), 45.0)), ("world", min(44.0 + 0.5 * n, 45.0), 45.0)]
    assert n > 1 and out.words[-1].end == 45.0  # (the late window's last word would end at 44.5 + 0.5 * ...: clamped)
