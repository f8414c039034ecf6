"""Logging refused peer input without letting a flood of it flood the log."""

from __future__ import annotations

import logging
import time


class RefusalLog:
    """Logs each kind of refusal at most once per `interval` seconds, with how many were not logged.

    A peer that sends junk as fast as it can must not turn the server's log (or its disk) into the
    bottleneck, yet the operator has to learn that it happens and why.
    """

    def __init__(self, logger: logging.Logger, interval: float = 5.0):
        self.logger = logger
        self.interval = interval
        self.count = 0  # every refusal, logged or not
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def refuse(self, kind: str, message: str, *args: object, level: int = logging.WARNING,
               exc_info: bool = False) -> None:
        """Count one refusal of `kind`; log it unless one of the same kind was logged lately."""
        self.count += 1
        now = time.monotonic()
        if now - self._last.get(kind, -self.interval) < self.interval:
            self._quiet[kind] = self._quiet.get(kind, 0) + 1
            return
        self._last[kind] = now
        quiet = self._quiet.pop(kind, 0)
        suffix = f" ({quiet} more like it since the last report)" if quiet else ""
        self.logger.log(level, message + suffix, *args, exc_info=exc_info)
