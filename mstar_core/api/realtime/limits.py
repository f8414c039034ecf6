"""Bounds on realtime sessions; `MSTAR_REALTIME_<NAME>` environment variables override them
(e.g. `MSTAR_REALTIME_MAX_SESSIONS=8`); a bad value is a ConfigError naming the variable."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from mstar_core.api.media.limits import env_overrides


@attrs.frozen
class RealtimeLimits:
    #: sessions open at once on this server (each also counts as one request in flight for admission)
    max_sessions: int = 64
    #: one client event's bytes (a larger frame gets an error event; past the server's websocket limit,
    #: 16 MiB by default, the connection is closed with 1009)
    max_event_bytes: int = 8 * 1024 * 1024
    #: seconds of audio the input buffer holds before a commit (an append past it is refused)
    max_buffer_seconds: float = 120.0
    #: conversation items kept, and seconds of user audio in them (oldest dropped first)
    max_items: int = 100
    max_history_audio_seconds: float = 600.0
    #: bytes of a session's conversation as held (decoded images and video frames, audio, text); oldest dropped
    #: first, and one item larger than this is refused
    max_history_bytes: int = 128 * 1024 * 1024
    #: a session's whole life, and how long it may go without a client event
    max_session_seconds: float = 3600.0
    idle_seconds: float = 600.0
    #: server events waiting for the socket; a client that reads none for `send_timeout` seconds is dropped
    send_queue: int = 256
    send_timeout: float = 10.0
    #: bytes of server events waiting for the socket (their JSON); past it an event waits as for a full queue
    max_queued_bytes: int = 16 * 1024 * 1024
    #: a voice agent's reply starts after this much silence in the user's speech, held until the VAD's stop
    #: (`silence_duration_ms`) commits the same turn, dropped if the user speaks on (at or above a session's
    #: silence_duration_ms: the reply starts at the stop)
    preemptive_after_ms: int = 100

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RealtimeLimits:
        return attrs.evolve(cls(), **env_overrides(cls, "MSTAR_REALTIME_", environ))
