"""Sending to one worker on the control socket: encode, pack for its link, seal for its session, hand to the socket.

Sealing and handing to the socket happen in one synchronous call (`sealed.send_sealed`), so the
sequence numbers of one session go out in order whoever sends. What the worker's link has for its
other end (shm slots released, segments mapped) goes first, on the same session.
"""

from __future__ import annotations

import asyncio
from typing import Any

from mstar_core.cluster.control_socket import ControlSocket
from mstar_core.cluster.sealed import send_sealed
from mstar_core.cluster.worker_link import WorkerLink, WorkerLost
from mstar_core.errors import RequestError
from mstar_core.wire import WireError


class WorkerSender:
    """Sends sealed messages to workers through the control socket; owns nothing but the way there."""

    def __init__(self, socket: ControlSocket):
        self.socket = socket

    def send(self, state: WorkerLink, msg: Any) -> asyncio.Future:
        """Encode and send now (a WireError raises here, before anything went out); await to wait for the socket."""
        return self.send_frames(state, state.encode(msg))

    def send_frames(self, state: WorkerLink, frames: list[Any]) -> asyncio.Future:
        if state.identity is None or state.channel is None:
            raise WorkerLost(f"worker '{state.name}' is not connected")
        if state.link is not None:
            frames = state.link.pack(frames)
            ctl = state.link.control()
            if ctl is not None:
                send_sealed(self.socket.sock, state.channel, ctl, head=(state.identity,))
        return send_sealed(self.socket.sock, state.channel, frames, head=(state.identity,))

    async def send_or_fail(self, state: WorkerLink, frames: list[Any], future: asyncio.Future) -> None:
        """Send in the background; a failure fails `future` (the call it carried) instead of going unseen."""
        try:
            await self.send_frames(state, frames)
        except Exception as exc:
            if not future.done():
                future.set_exception(exc if isinstance(exc, RequestError) else WorkerLost(
                    f"worker '{state.name}': sending failed: {exc}"))

    def notify(self, state: WorkerLink | None, msg: Any) -> None:
        """Send a control message that needs no answer; a worker that is gone takes its requests with it."""
        if state is None or not state.alive or state.channel is None:
            return
        try:
            asyncio.ensure_future(self.send_or_fail(state, state.encode(msg), asyncio.get_running_loop().create_future()))
        except WireError:
            pass

    def flush_soon(self, state: WorkerLink) -> None:
        """Send the worker's link what ours has for it (e.g. the shm slots we released, the segments we mapped)."""
        if state.link is None or state.identity is None or state.channel is None:
            return
        ctl = state.link.control()
        if ctl is not None:
            send_sealed(self.socket.sock, state.channel, ctl, head=(state.identity,))
