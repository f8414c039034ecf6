"""One opened message from a worker, decoded and handed to its `WorkerLink` (answers, loop values, gauges, reports).

Used by the receive loop (`receiver.py`) and by each worker's `OrderedInbox` (messages whose big
frames arrived over the worker's link after their header): whichever way a message came, it ends here.
"""

from __future__ import annotations

import logging
from typing import Any

from mstar_core.cluster.refusals import RefusalLog
from mstar_core.cluster.worker_link import WorkerLink
from mstar_core.wire import (
    ErrorReport,
    Heartbeat,
    LoopDone,
    LoopValues,
    ModelLoaded,
    NodeResult,
    WireError,
    decode,
)


class WorkerMessages:
    """Decodes a worker's message and routes it by type; anything malformed or unexpected is refused and logged."""

    def __init__(self, refusals: RefusalLog):
        self.refusals = refusals

    def deliver(self, state: WorkerLink, body: list[Any]) -> None:
        try:
            msg = decode(body)
        except WireError as exc:
            self.refusals.refuse("malformed-worker", "dropping a malformed message from worker %s: %s", state.name, exc)
            return
        state.count("received", msg, body)
        self._dispatch(state, msg)

    def _dispatch(self, state: WorkerLink, msg: Any) -> None:
        if isinstance(msg, NodeResult):
            state.on_result(msg)
        elif isinstance(msg, LoopValues | LoopDone):
            state.on_loop_message(msg)
        elif isinstance(msg, Heartbeat):
            state.load = msg.load
        elif isinstance(msg, ModelLoaded):
            state.on_loaded(msg)
        elif isinstance(msg, ErrorReport):
            self.refusals.refuse(f"report-{state.name}", "worker %s: %s: %s", state.name, msg.error_type, msg.message,
                                 level=logging.ERROR)
            state.on_error_report(msg)
        else:
            self.refusals.refuse("unexpected", "worker %s sent a %s, which workers never send; dropped", state.name,
                                 type(msg).__name__)
