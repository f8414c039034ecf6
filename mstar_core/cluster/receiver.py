"""The control socket's receive loop: open each sealed batch under its session and pass its messages on, in order.

No bytes from any peer stop this loop: each refusal is logged (rate-limited) and the loop goes on.
An unsealed message goes to the handshake (only a Hello may come unsealed), one under a session
that is not live goes there too (a lost worker still talking); the rest reach their `WorkerLink`
through its link's inbox (`links.OrderedInbox`), so frames still arriving over the link keep their order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq

from mstar_core.cluster.control_socket import ControlSocket
from mstar_core.cluster.handshake import Handshake
from mstar_core.cluster.refusals import RefusalLog
from mstar_core.cluster.sessions import Sessions
from mstar_core.cluster.worker_link import WorkerLink
from mstar_core.wire import AuthError, WireError
from mstar_core.wire.batch import split_messages
from mstar_core.wire.session import session_of

log = logging.getLogger("mstar.cluster")


class ControlReceiver:
    """Owns the receive task; `ensure_receiving` (each supervision round) starts it again should it ever die."""

    def __init__(self, socket: ControlSocket, sessions: Sessions, handshake: Handshake,
                 deliver: Callable[[WorkerLink, list[Any]], None], refusals: RefusalLog):
        self.socket = socket
        self.sessions = sessions
        self.handshake = handshake
        self._deliver = deliver
        self.refusals = refusals
        self.task: asyncio.Task | None = None
        self.stopped = False

    def ensure_receiving(self) -> None:
        """Start the receive loop, or restart it if it ever died (logged: it must not, but it must not stay dead)."""
        task = self.task
        if task is not None and not task.done():
            return
        if task is not None and not task.cancelled() and task.exception() is not None and not self.stopped:
            log.error("control socket receive loop died; restarting it", exc_info=task.exception())
        if not self.stopped:
            self.task = asyncio.ensure_future(self._receive())

    def stop(self) -> None:
        """No more receiving (the cluster is closing); the task itself is cancelled by `close`."""
        self.stopped = True

    def close(self) -> None:
        self.stopped = True
        if self.task is not None:
            self.task.cancel()

    async def _receive(self) -> None:
        while not self.stopped:
            try:
                frames = await self.socket.sock.recv_multipart(copy=False)
            except zmq.ZMQError as exc:
                if self.stopped or exc.errno == zmq.ETERM:
                    return
                self.refusals.refuse("socket", "control socket receive failed: %s", exc)
                await asyncio.sleep(0.01)
                continue
            try:
                await self._on_frames(frames[0].bytes, [f.buffer for f in frames[1:]])
            except Exception:  # a bug in handling one message must not stop the control plane
                self.refusals.refuse("bug", "control message from %r could not be handled", frames[0].bytes[:32],
                                     level=logging.ERROR, exc_info=True)

    async def _on_frames(self, identity: bytes, body: list[Any]) -> None:
        session = session_of(body)
        if session is None:  # only a Hello travels unsealed
            await self.handshake.on_unsealed(identity, body)
            return
        state = self.sessions.get(session)
        if state is None or state.channel is None:
            self.handshake.on_stale_session(identity, session, body)
            return
        try:
            body = state.channel.open(body)
        except AuthError as exc:
            self.refusals.refuse("forged", "refused a message for worker %s's session from %r: %s", state.name,
                                 identity[:32], exc)
            return
        if identity != state.identity:  # the worker reconnected: answer where its sealed messages come from
            log.info("worker %s now reaches us from routing id %r", state.name, identity)
            state.identity = identity
        state.last_seen = time.monotonic()
        state.socket_messages_received += 1
        try:
            messages = split_messages(body)  # a worker sends what one turn of its event loop produced at once
        except WireError as exc:
            self.refusals.refuse("malformed-worker", "dropping a malformed batch from worker %s: %s", state.name, exc)
            return
        for message in messages:
            self._on_message(state, message)

    def _on_message(self, state: WorkerLink, body: Any) -> None:
        if state.link is not None:
            try:
                body = state.link.unpack(body)
            except WireError as exc:
                self.refusals.refuse("malformed-worker", "dropping a malformed message from worker %s: %s",
                                     state.name, exc)
                return
            if body is None:
                return  # a message for the link itself (e.g. shm slots released, segments mapped)
        if state.inbox is not None:
            state.inbox.put(body)  # in order; frames still arriving over the link wait there, not here
        else:
            self._deliver(state, body)
