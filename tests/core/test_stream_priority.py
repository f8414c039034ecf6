"""`stream_priority`: how far behind a listener is, before and after its stream's first chunk."""

from __future__ import annotations

import pytest

from mstar_core.graph import stream_priority
from mstar_core.graph.walk import StreamProgress


def progress(now: float, first: float | None = None, chunks: int = 0, released: int = 0) -> StreamProgress:
    return StreamProgress(items=released, released=released, chunks=chunks, started=10.0, first_release=first,
                          now=now)


def test_playing_stream_is_ranked_by_the_audio_it_has_left():
    rank = stream_priority(per_chunk=0.085)
    # 4 windows released 0.1 s ago: 0.34 s queued, 0.1 s played -> 0.24 s ahead -> priority -0.24
    assert rank(progress(11.1, first=11.0, chunks=4)) == pytest.approx(-0.24)
    # the start lead changes nothing once a stream plays
    assert stream_priority(per_chunk=0.085, start_lead=2.0)(progress(11.1, first=11.0, chunks=4)) == \
        pytest.approx(-0.24)


def test_waiting_stream_without_a_start_lead_outranks_any_playing_one_with_audio_queued():
    rank = stream_priority(per_chunk=0.085)
    assert rank(progress(10.05)) == pytest.approx(0.05)  # waited 50 ms: already behind
    assert rank(progress(10.05)) > rank(progress(11.1, first=11.0, chunks=4))


def test_start_lead_lets_a_waiting_stream_yield_until_it_has_waited_that_long():
    rank = stream_priority(per_chunk=0.085, start_lead=1.0)
    playing = rank(progress(11.1, first=11.0, chunks=4))  # 0.24 s ahead
    assert rank(progress(10.05)) == pytest.approx(-0.95)
    assert rank(progress(10.05)) < playing  # the playing stream goes first
    assert rank(progress(10.8)) > playing  # waited 0.8 s: now less than 0.24 s of lead left
    assert rank(progress(12.0)) == pytest.approx(1.0)  # and it keeps getting more urgent


def test_priority_is_clamped_to_the_horizon():
    rank = stream_priority(per_chunk=0.085, horizon=5.0, start_lead=100.0)
    assert rank(progress(10.0)) == -5.0
    assert stream_priority(horizon=5.0)(progress(100.0)) == 5.0
