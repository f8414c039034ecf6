"""Which worker each sealed session speaks for, and the sessions of lost workers (so a late one can be told to leave)."""

from __future__ import annotations

import collections

from mstar_core.cluster.worker_link import WorkerLink
from mstar_core.wire.session import Channel

#: Sessions of lost workers remembered, to tell a worker that wakes up later to leave.
RETIRED_SESSIONS = 64


class Sessions:
    """Live sessions by id, and a bounded memory of retired ones."""

    def __init__(self):
        self._live: dict[bytes, WorkerLink] = {}
        self._retired: collections.OrderedDict[bytes, tuple[Channel, WorkerLink]] = collections.OrderedDict()

    def get(self, session: bytes) -> WorkerLink | None:
        return self._live.get(session)

    def open(self, channel: Channel, state: WorkerLink) -> None:
        self._live[channel.session] = state

    def drop(self, session: bytes) -> None:
        """Forget a session that was never welcomed (its worker's link could not be set up)."""
        self._live.pop(session, None)

    def retire(self, state: WorkerLink) -> None:
        """Forget a lost worker's session; a message that still comes under it gets a Shutdown back."""
        channel = state.channel
        if channel is not None:
            self._live.pop(channel.session, None)
            self._retired[channel.session] = (channel, state)
            while len(self._retired) > RETIRED_SESSIONS:
                self._retired.popitem(last=False)

    def retired(self, session: bytes) -> tuple[Channel | None, WorkerLink | None]:
        return self._retired.get(session, (None, None))

    def forget_retired(self, session: bytes) -> None:
        self._retired.pop(session, None)
