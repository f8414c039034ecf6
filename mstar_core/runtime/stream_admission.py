"""The node setting `admit_streams`: admit a streamed request only while the admitted ones stay ahead of real time.

A fixed `max_active_requests` is sized to one measurement of the machine's speed; on a machine whose share of the
CPU or device moves (other work, longer prompts, a slower voice), the same number either leaves speed unused or lets
every admitted stream run dry. This policy reads what the streams' listeners would hear instead: each ranked call
carries its request's lead (`Invocation.lead`: seconds of media made beyond what has played, from the walk's
`StreamPriority`), and the node's scheduler admits the oldest waiting request only while

- fewer than `max_starting` admitted requests are still starting (no playback yet, or too short a one to have a
  measured speed): a starting request's prompt and first window cost an unknown share of the steps, so the next one
  waits until it plays and its speed shows what is left;
- every playing admitted request is at least `min_lead_s` ahead of its listener; and
- every playing admitted request's measured speed (media seconds made per wall second, over spans of at least
  `speed_window_s`) is at least `min_speed` with the requests admitted now. The reading is smoothed pessimistically:
  a slower span counts at once, a faster one by half (a box shared with other work gives its share back in bursts,
  and a stream admitted on the fast half of a burst runs dry in the slow half: BENCHMARKS.md's Qwen3-TTS runs F, H).

The lead counts media made but not yet released to the listener (`StreamPriority.lead`): a stream released in
windows holds up to one window back, so what its listener has buffered just before a window lands is its lead less
one window. `min_lead_s` under one window does not tell a stream about to run dry from a safe one; a model sets it
above its window (Qwen3-TTS: 2-s windows, `min_lead_s` 3.0 in its default).

The speed is measured, not projected: on a CPU a step's cost is mostly its fixed part (one Talker step served one
stream or two in about the same time in the Qwen3-TTS traces, BENCHMARKS.md), so a model of cost per request would
keep places empty; the margin over real time is what one more request may take, and since one starts at a time its
effect shows in the readings before the next one joins.

With nothing admitted, the oldest waiting request is admitted at once. An admitted request keeps its place until it
is released (ends, fails, is cancelled): the policy never takes a stream off the air, it only keeps new ones waiting,
and a waiting request has not started playing, so it cannot run dry; its listener hears a later start instead. How
many wait is the server's queue bound (`Admission`, `max_queued`).

Put it on the node that starts a request's streamed work (Qwen3-TTS's and Orpheus's Talker): the later nodes of the
loop then only ever see admitted requests. A request whose calls carry no lead (no ranked stream, or a node on
another worker: the lead does not cross the wire yet) counts as starting for as long as it holds its place.

Pure policy: `StreamLeads` keeps the readings and answers `may_admit`; the scheduler feeds it the calls it is given
and asks it before each admission.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import attrs

from mstar_core.errors import ConfigError


@attrs.frozen
class StreamAdmission:
    """The node setting `admit_streams` (`true` for these defaults, or a mapping of the fields to change)."""

    #: seconds of media every playing admitted stream must have ahead of its listener (made, released or not: set it
    #: above the stream's release window, see the module's docstring)
    min_lead_s: float = 1.5
    #: the speed (media seconds per wall second) every playing admitted stream must be measured at
    min_speed: float = 1.5
    #: admitted requests allowed to be starting at once
    max_starting: int = 1
    #: the shortest span of lead readings a speed is measured over (a shorter one is dominated by step jitter and
    #: by the moments other work leaves the machine alone: 1.0 / 1.25x / 0.5 s admitted on readings the load took
    #: back, BENCHMARKS.md's Qwen3-TTS run F)
    speed_window_s: float = 1.0

    @classmethod
    def from_setting(cls, node: str, value: Any) -> StreamAdmission | None:
        """The setting checked (None or false: off), errors naming the node and the key."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if not isinstance(value, Mapping):
            raise ConfigError(f"node '{node}': setting 'admit_streams' must be true or a mapping of "
                              f"{', '.join(map(repr, _FIELDS))}, got {value!r}")
        fields: dict[str, Any] = {}
        for key, given in value.items():
            if key not in _FIELDS:
                raise ConfigError(f"node '{node}': setting 'admit_streams.{key}' is unknown; known: "
                                  f"{', '.join(map(repr, _FIELDS))}")
            fields[key] = _checked(node, key, given)
        return cls(**fields)


_FIELDS = tuple(a.name for a in attrs.fields(StreamAdmission))


def _checked(node: str, key: str, value: Any) -> Any:
    where = f"node '{node}': setting 'admit_streams.{key}'"
    if key == "max_starting":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where} must be a positive integer, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if key == "min_lead_s" and value < 0:
        raise ConfigError(f"{where} must be >= 0, got {value!r}")
    if key in ("min_speed", "speed_window_s") and value <= 0:
        raise ConfigError(f"{where} must be > 0, got {value!r}")
    return float(value)


@attrs.define
class _Reading:
    """One admitted request's stream as its calls showed it."""

    lead: float | None = None  # the latest lead (None: not playing yet)
    since: tuple[float, float] | None = None  # (time, lead) the current speed span starts at
    speed: float | None = None  # media seconds per wall second, smoothed over spans


class StreamLeads:
    """The admitted requests' latest leads and measured speeds, and the admission rule over them."""

    def __init__(self, policy: StreamAdmission):
        self.policy = policy
        self._readings: dict[str, _Reading] = {}

    def observe(self, request_id: str, lead: float | None, now: float) -> None:
        """A call of `request_id` was made at `now` with the listener `lead` seconds ahead."""
        reading = self._readings.setdefault(request_id, _Reading())
        reading.lead = lead
        if lead is None:
            return
        if reading.since is None:
            reading.since = (now, lead)
            return
        began, lead_then = reading.since
        span = now - began
        if span >= self.policy.speed_window_s:
            # the lead grows by (speed - 1) seconds a second: media made minus media played
            speed = 1.0 + (lead - lead_then) / span
            if reading.speed is None or speed < reading.speed:
                reading.speed = speed  # a slowdown counts at once
            else:
                reading.speed = 0.5 * (reading.speed + speed)  # a speed-up by half: it may be a lull in other work
            reading.since = (now, lead)

    def forget(self, request_id: str) -> None:
        self._readings.pop(request_id, None)

    def speed(self, request_id: str) -> float | None:
        reading = self._readings.get(request_id)
        return None if reading is None else reading.speed

    def may_admit(self, admitted: Collection[str]) -> bool:
        """Whether one more request may join `admitted` (the requests holding a place now)."""
        if not admitted:
            return True
        policy = self.policy
        playing = [r for r in map(self._readings.get, admitted) if r is not None and r.lead is not None
                   and r.speed is not None]
        if len(admitted) - len(playing) >= policy.max_starting:
            return False
        return all(r.lead >= policy.min_lead_s and r.speed >= policy.min_speed for r in playing)
