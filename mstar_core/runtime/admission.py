"""Exact admission: a request takes its place (queued, later running) in one step and gives it back once."""

from __future__ import annotations

from mstar_core.errors import RequestError

#: How long a refused client is told to wait before retrying (seconds); also sent in milliseconds.
RETRY_AFTER_S = 1.0


class AtCapacity(RequestError):
    """Every running and queued place is taken: retry later (503 with Retry-After)."""

    status = 503
    error_type = "server_overloaded"

    def __init__(self, message: str, retry_after_s: float = RETRY_AFTER_S):
        super().__init__(message, status=503)
        self.retry_after_s = retry_after_s


class Admission:
    """Counts places: at most `max_running + max_queued` requests hold one at any instant.

    The check and the take are one synchronous call (no await between them), so a burst of any
    size and timing admits exactly the free places; a place moves from queued to running without
    ever leaving the count, so a slot being handed on never opens a gap for a newcomer.
    """

    def __init__(self, max_running: int, max_queued: int):
        self.max_running = max_running
        self.max_queued = max_queued
        self.running = 0
        self.waiting = 0

    @property
    def capacity(self) -> int:
        return self.max_running + self.max_queued

    def take(self) -> Place:
        """A queued place, or `AtCapacity` when none is free."""
        if self.running + self.waiting >= self.capacity:
            raise AtCapacity(f"server is at capacity ({self.running} running, {self.waiting} queued, "
                             f"limits {self.max_running} + {self.max_queued}); retry later")
        self.waiting += 1
        return Place(self)


class Place:
    """One request's place; `start` moves it from queued to running, `release` gives it back (idempotent)."""

    __slots__ = ("_admission", "state")

    def __init__(self, admission: Admission):
        self._admission = admission
        self.state = "queued"

    def start(self) -> None:
        if self.state == "queued":
            self._admission.waiting -= 1
            self._admission.running += 1
            self.state = "running"

    def release(self) -> None:
        if self.state == "queued":
            self._admission.waiting -= 1
        elif self.state == "running":
            self._admission.running -= 1
        self.state = "released"

    @property
    def released(self) -> bool:
        return self.state == "released"
