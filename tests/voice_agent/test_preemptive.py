"""Preemptive generation on a voice agent's realtime session: the reply starts at a pause in the user's speech, held
(nothing of it reaches the client) until the VAD's stop commits the same turn; speech that resumes drops it and
frees its pages (the served checks: tests/voice_agent/test_realtime.py). Here: the detector's pauses."""

from __future__ import annotations

import numpy as np

from mstar_core.api.realtime.vad import EnergyScorer, TurnDetector
from tests.realtime.helpers import silence, tone


def _events(detector: TurnDetector, pcm: np.ndarray, chunk: int = 480) -> list[tuple[str, int]]:
    return [(e.kind, e.ms) for at in range(0, pcm.size, chunk) for e in detector.feed(pcm[at:at + chunk])]


def test_the_detector_reports_a_pause_and_speech_that_resumes_before_the_stop():
    pcm = np.concatenate([silence(0.5), tone(0.6), silence(0.2), tone(0.4), silence(0.6)])
    d = TurnDetector(0.5, silence_duration_ms=300, scorer_factory=EnergyScorer, pause_ms=100)
    # the pause's ms is the stop's audio_end_ms, were the silence to last: the same turn's samples
    assert _events(d, pcm) == [("started", 500), ("paused", 1100), ("resumed", 1300), ("paused", 1700),
                               ("stopped", 1700)]
    plain = TurnDetector(0.5, silence_duration_ms=300, scorer_factory=EnergyScorer)
    assert _events(plain, pcm) == [("started", 500), ("stopped", 1700)]  # (no pause_ms: as before)

