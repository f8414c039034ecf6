"""Workers joining: the HMAC-signed Hello, the Welcome that opens a sealed session, and peers that must be refused.

Only a Hello travels unsealed; every later message either way is sealed for its session
(`mstar_core.wire.session`), so a peer that can reach the socket but lacks the secret cannot speak
for a worker, whatever routing id it claims. A refused peer is told nothing. A hand-started worker
whose Hello comes before a placement names it is held a while and welcomed once one does; a worker
declared lost that is still talking under its old session is told to leave (or to join again).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Mapping
from typing import Any

from mstar_core.cluster.control_socket import ControlSocket
from mstar_core.cluster.refusals import RefusalLog
from mstar_core.cluster.sealed import send_sealed
from mstar_core.cluster.sender import WorkerSender
from mstar_core.cluster.sessions import Sessions
from mstar_core.cluster.supervision import Supervisor
from mstar_core.cluster.worker_link import WorkerLink
from mstar_core.wire import AuthError, Hello, Shutdown, WireError, decode, encode
from mstar_core.wire.auth import HelloVerifier
from mstar_core.wire.session import Channel, new_session_id

#: How long a worker's Hello waits for a placement that names it (the worker waits MSTAR_JOIN_TIMEOUT, 15 s by
#: default, for its Welcome), and how many such Hellos are kept.
EARLY_HELLO_S = 60.0
MAX_EARLY_HELLOS = 64

log = logging.getLogger("mstar.cluster")


class Handshake:
    """Verifies Hellos, opens sessions, holds early Hellos, and counts the peers it refused."""

    def __init__(self, socket: ControlSocket, workers: Mapping[str, WorkerLink], sessions: Sessions,
                 sender: WorkerSender, supervisor: Supervisor, refusals: RefusalLog, heartbeat_interval: float):
        self.socket = socket
        self.workers = workers
        self.sessions = sessions
        self.sender = sender
        self.supervisor = supervisor
        self.refusals = refusals
        self.heartbeat_interval = heartbeat_interval
        self.verifier = HelloVerifier(socket.secret)
        #: authenticated Hellos of hand-started workers that came before a placement named them, by name
        self.early: collections.OrderedDict[str, tuple[bytes, Hello, float]] = collections.OrderedDict()
        self.refused = 0  # peers that failed authentication
        self._tasks: list[asyncio.Task] = []

    async def on_unsealed(self, identity: bytes, body: list[Any]) -> None:
        """A message under no session: a Hello, or refused."""
        try:
            msg = decode(body)
        except WireError as exc:
            self.refused += 1
            self.refusals.refuse("malformed", "dropping a malformed message from unauthenticated peer %r: %s",
                                 identity[:32], exc)
            return
        if not isinstance(msg, Hello):
            self.refused += 1
            self.refusals.refuse("unauthenticated", "dropping a %s from unauthenticated peer %r (only a Hello may "
                                 "come unsealed)", type(msg).__name__, identity[:32])
            return
        await self._on_hello(identity, msg)

    async def _on_hello(self, identity: bytes, hello: Hello) -> None:
        state = self.workers.get(hello.worker)
        try:
            self.verifier.verify(hello)
            if state is None:
                # `mstar worker --join` may start before the server loads the model that places it: keep the
                # (authenticated) Hello a while and welcome it when a placement names the worker
                self.early[hello.worker] = (identity, hello, time.monotonic())
                self.early.move_to_end(hello.worker)
                while len(self.early) > MAX_EARLY_HELLOS:
                    self.early.popitem(last=False)
                log.info("worker %s joined before a placement named it; held for %.0f s", hello.worker, EARLY_HELLO_S)
                return
            process = state.process
            if state.spec.spawned and process is not None and process.poll() is None and hello.pid != process.pid:
                raise AuthError(f"worker {hello.worker!r} is this server's process {process.pid}; a second process "
                                f"(pid {hello.pid}) may not take its name")
        except AuthError as exc:
            self.refused += 1
            self.refusals.refuse("hello", "refused a worker: %s", exc)
            return  # say nothing: an unauthenticated peer learns nothing
        await self._welcome(identity, hello, state)

    def welcome_early(self, state: WorkerLink) -> None:
        """A placement now names `state`: welcome its hand-started worker if its Hello came (lately) before."""
        early = self.early.pop(state.name, None)
        if early is not None and not state.spec.spawned and time.monotonic() - early[2] < EARLY_HELLO_S:
            self._tasks.append(asyncio.get_running_loop().create_task(self._welcome(early[0], early[1], state)))

    async def _welcome(self, identity: bytes, hello: Hello, state: WorkerLink) -> None:
        """Open a session for an authenticated worker and answer its Hello."""
        session = new_session_id()
        welcome = self.verifier.welcome(hello, session=session, heartbeat_interval=self.heartbeat_interval,
                                        transport=state.spec.transport)
        if state.alive:  # the same worker joining again: what the old session had in flight is gone
            self.supervisor.lost(state, "joined again under a new session", restart=False)
        channel = Channel.for_coordinator(self.socket.secret, hello.nonce, session)
        state.identity = identity
        state.channel = channel
        state.pid, state.host = hello.pid, hello.host
        self.sessions.open(channel, state)
        state.last_seen = time.monotonic()
        if state.link is not None:
            try:  # e.g. a tensor group's rendezvous for this worker; its set-up goes sealed right after the Welcome
                state.link.peer_joined({"control": self.socket.address, "device": state.spec.device})
            except Exception as exc:  # not welcomed: ensure_worker fails with this reason
                state.link_error = f"its {state.link.name} link cannot be set up: {exc}"
                self.sessions.drop(channel.session)
                state.identity = state.channel = None
                log.error("worker %s: %s", state.name, state.link_error)
                return
        await self.socket.sock.send_multipart([identity, *encode(welcome)])
        self.sender.flush_soon(state)
        state.alive = True
        state.joined.set()
        if state.loads and not state.restarting:  # a hand-joined worker came back: reload its models
            self.supervisor.start_restart(state)

    def on_stale_session(self, identity: bytes, session: bytes, body: list[Any]) -> None:
        """A message under a session that is not live: a lost worker still talking gets a Shutdown, anyone else nothing."""
        channel, state = self.sessions.retired(session)
        if channel is not None:
            try:
                channel.open(body)  # only the worker itself earns an answer
            except AuthError:
                channel = None
        if channel is None:
            self.refused += 1
            self.refusals.refuse("session", "dropping a message for an unknown session from %r", identity[:32])
            return
        self.sessions.forget_retired(session)
        log.warning("a worker declared lost earlier is still talking (from %r); telling it to exit", identity[:32])
        # a hand-joined worker joins again under a new session (the server reloads its models), unless another
        # process took its name meanwhile; a spawned one exits (its replacement is already on the way)
        rejoin = state is not None and not state.alive and not state.spec.spawned
        shutdown = Shutdown(reason="the server declared this worker lost (it stopped answering heartbeats, e.g. "
                                   "cut off by the network); " + ("join again" if rejoin else "it was replaced"),
                            rejoin=rejoin)
        send_sealed(self.socket.sock, channel, encode(shutdown), head=(identity,))

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
