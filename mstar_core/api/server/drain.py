"""Graceful drain: on SIGTERM/SIGINT the server refuses new requests (503) while it still listens, lets in-flight
requests finish within `--drain-timeout`, and only then stops (uvicorn's shutdown, then the engine and workers)."""

from __future__ import annotations

import logging
import time
from typing import Any

import uvicorn

log = logging.getLogger("mstar.api")


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first stop signal drains instead of closing the listening socket at once.

    Closing it at once would turn every new request into a connection refused (and a request racing the
    signal into a reset); a load balancer reads a 503 with Retry-After and moves on. A second signal, or a
    signal before the models are in, stops at once as uvicorn does.
    """

    def __init__(self, config: uvicorn.Config, state: Any, drain_timeout: float):
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self.drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.drain_deadline is not None or not self.state.ready or self.drain_timeout <= 0:
            super().handle_exit(sig, frame)
            return
        self._captured_signals.append(sig)  # uvicorn re-raises it after the shutdown, as for a plain stop
        self.state.draining = True
        self.drain_deadline = time.monotonic() + self.drain_timeout
        log.info("draining: new requests get 503; %d in flight get up to %.0f s", self.in_flight(), self.drain_timeout)

    def in_flight(self) -> int:
        """Requests the engine runs or queues, handles not yet done, and requests still waiting for their grammar
        to compile (the engine has not seen them yet)."""
        from mstar_core.grammar import compile as grammar_compile

        engine = self.state.engine
        if engine is None:
            return 0
        return (int(engine.running + engine.waiting) + sum(1 for h in self.state._inflight if not h.done)
                + grammar_compile.waiting())

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            left = self.in_flight()
            if left == 0 or time.monotonic() >= self.drain_deadline:
                if left:
                    log.warning("drain timeout: %d request(s) still in flight are cancelled", left)
                    from mstar_core.grammar import compile as grammar_compile

                    grammar_compile.give_up_waiting()  # their 503s go out now, not after uvicorn's own timeout
                self.should_exit = True
        return await super().on_tick(counter)
