"""`admit_streams`: a new request is admitted only while the admitted streams stay ahead of real time.

Timing-free: leads and times are made up (the scheduler's clock is injected); a recording engine shows which
requests' calls reached it.
"""

from __future__ import annotations

import asyncio

import pytest

from mstar_core.errors import ConfigError
from mstar_core.graph import stream_priority
from mstar_core.graph.walk import StreamProgress
from mstar_core.runtime.conductor import _lead
from mstar_core.runtime.engine import Invocation
from mstar_core.runtime.scheduler import NodeScheduler
from mstar_core.runtime.stream_admission import StreamAdmission, StreamLeads
from tests.core.helpers import Recording

POLICY = StreamAdmission(min_lead_s=1.0, min_speed=1.25, max_starting=1, speed_window_s=0.3)


def test_setting_true_is_the_defaults_and_a_mapping_changes_named_fields():
    assert StreamAdmission.from_setting("talker", True) == StreamAdmission()
    assert StreamAdmission.from_setting("talker", None) is None
    assert StreamAdmission.from_setting("talker", False) is None
    got = StreamAdmission.from_setting("talker", {"min_speed": 2, "max_starting": 3})
    assert got == StreamAdmission(min_speed=2.0, max_starting=3)


@pytest.mark.parametrize(("value", "named"), [
    ({"min_lead": 1.0}, "admit_streams.min_lead'"),
    ({"min_speed": 0}, "admit_streams.min_speed'"),
    ({"min_speed": "fast"}, "admit_streams.min_speed'"),
    ({"min_lead_s": -1}, "admit_streams.min_lead_s'"),
    ({"max_starting": 0}, "admit_streams.max_starting'"),
    ({"max_starting": 1.5}, "admit_streams.max_starting'"),
    ({"speed_window_s": float("nan")}, "admit_streams.speed_window_s'"),
    (3, "admit_streams'"),
])
def test_bad_setting_names_the_node_and_key(value, named):
    with pytest.raises(ConfigError, match=f"node 'talker': setting '{named}"):
        StreamAdmission.from_setting("talker", value)


def test_speed_is_the_slope_of_the_lead_plus_one_over_spans_of_the_window():
    leads = StreamLeads(POLICY)
    leads.observe("a", None, 0.0)  # starting: no speed
    leads.observe("a", 2.0, 1.0)
    leads.observe("a", 2.1, 1.1)  # 0.1 s: under the window, no reading yet
    assert leads.speed("a") is None
    leads.observe("a", 2.5, 1.5)  # +0.5 s of lead over 0.5 s: made 1.5 s of media in 0.5 s
    assert leads.speed("a") == pytest.approx(2.0)
    leads.observe("a", 2.5, 2.0)  # the lead held still: real time exactly; a slowdown counts at once
    assert leads.speed("a") == pytest.approx(1.0)
    leads.observe("a", 3.5, 2.5)  # 3 x real time over this span: a speed-up counts by half
    assert leads.speed("a") == pytest.approx(2.0)
    leads.observe("a", 3.5, 3.0)  # and the next slow span brings it straight down again
    assert leads.speed("a") == pytest.approx(1.0)
    leads.forget("a")
    assert leads.speed("a") is None


def _playing(leads: StreamLeads, rid: str, lead: float, speed: float) -> None:
    """`rid` read afresh: `lead` seconds ahead now, at `speed` over the last second."""
    leads.forget(rid)
    leads.observe(rid, lead - 1.0 * (speed - 1.0), 0.0)
    leads.observe(rid, lead, 1.0)


def test_admits_only_while_every_playing_stream_keeps_its_lead_and_speed_with_one_more():
    leads = StreamLeads(POLICY)
    assert leads.may_admit([])  # nothing admitted: the oldest always goes
    leads.observe("a", None, 0.0)
    assert not leads.may_admit(["a"])  # one starting already (max_starting 1)
    assert StreamLeads(StreamAdmission(max_starting=2)).may_admit(["a"])
    _playing(leads, "a", lead=2.0, speed=1.25)
    assert leads.may_admit(["a"])  # just the margin over real time
    _playing(leads, "a", lead=2.0, speed=1.2)
    assert not leads.may_admit(["a"])  # too little margin for one more
    _playing(leads, "a", lead=0.9, speed=5.0)
    assert not leads.may_admit(["a"])  # fast, but its listener is under a second from running dry
    _playing(leads, "a", lead=3.0, speed=4.0)
    _playing(leads, "b", lead=3.0, speed=4.0)
    assert leads.may_admit(["a", "b"])
    _playing(leads, "c", lead=3.0, speed=1.1)
    assert not leads.may_admit(["a", "b", "c"])  # the slowest decides


def test_lead_is_made_media_beyond_what_played_and_none_before_playback():
    rank = stream_priority(per_chunk=2.0, start_lead=2.0)
    waiting = StreamProgress(items=10, released=0, chunks=0, started=0.0, first_release=None, now=1.0)
    assert rank.lead(waiting) is None and rank(waiting) == pytest.approx(-1.0)  # the ranking is unchanged
    # one 25-item window released (2 s of audio) 0.4 s ago, 5 more items made since: 2.4 s made, 0.4 s played
    playing = StreamProgress(items=30, released=25, chunks=1, started=0.0, first_release=1.0, now=1.4)
    assert rank.lead(playing) == pytest.approx(2.0)
    assert rank(playing) == pytest.approx(-1.6)  # the ranking counts released audio only
    # a call ranked by several streams carries the lead of the one furthest behind; None while any has not started
    behind = StreamProgress(items=25, released=25, chunks=1, started=0.0, first_release=0.0, now=1.5)
    assert _lead([(rank, playing), (rank, behind)]) == pytest.approx(0.5)
    assert _lead([(rank, playing), (rank, waiting)]) is None
    assert _lead([(lambda p: 0.0, playing)]) is None  # a priority function that tells no lead


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _call(rid: str, arrival: float, lead: float | None) -> Invocation:
    return Invocation(rid, "n", {}, {}, 0, 0.0, arrival, lead)


async def test_scheduler_admits_the_next_stream_once_the_first_plays_fast_enough():
    engine = Recording(max_batch_size=64)
    engine.admit_streams = POLICY
    clock = Clock()
    sched = NodeScheduler(engine, None, clock)
    first, second = sched.submit(_call("a", 1.0, None)), sched.submit(_call("b", 2.0, None))
    await first
    assert engine.order == ["a"] and not second.done()  # 'a' is starting: 'b' waits
    await sched.submit(_call("a", 1.0, 2.0))  # 'a' plays: 2 s ahead, no speed yet
    clock.now = 0.5
    await sched.submit(_call("a", 1.0, 2.05))  # 1.1 x real time: too little margin
    assert not second.done()
    clock.now = 1.0
    third = sched.submit(_call("a", 1.0, 2.25))  # 1.4 x now, 1.25 smoothed: enough
    await asyncio.gather(second, third)
    assert engine.order == ["a", "a", "a", "a", "b"]
    await sched.close()


async def test_scheduler_admits_the_oldest_waiting_once_the_admitted_are_released():
    engine = Recording(max_batch_size=64)
    engine.admit_streams = POLICY
    sched = NodeScheduler(engine, None, Clock())
    started = sched.submit(_call("a", 1.0, None))
    waiting = [sched.submit(_call(rid, arrival, None)) for rid, arrival in (("c", 3.0), ("b", 2.0))]
    await started
    await sched.submit(_call("a", 1.0, 0.2))  # playing but about to run dry, whatever its speed
    assert not any(f.done() for f in waiting)
    sched.release("a")
    await waiting[1]  # 'b', the older one, not 'c'
    assert not waiting[0].done()
    sched.release("b")
    await waiting[0]
    assert engine.order == ["a", "a", "b", "c"]
    await sched.close()
