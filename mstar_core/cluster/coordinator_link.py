"""A worker's end of the control socket: join with a Hello, then send and receive sealed for the session.

One ZeroMQ DEALER socket carries wire-codec messages (typed JSON header, tensors as raw frames; no
pickle). Big tensor frames travel through the transport the Welcome names (looked up in the plugin
registry: `links.py`). What the worker sends in one turn of its event loop goes out as one sealed
message (`wire.batch`): a decode step of N requests costs the control socket one message, not N.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from typing import Any

import zmq
import zmq.asyncio

from mstar_core.cluster.links import open_link
from mstar_core.cluster.refusals import RefusalLog
from mstar_core.cluster.sealed import log_send_failure, send_sealed
from mstar_core.wire import WireError, decode, encode
from mstar_core.wire.auth import SECRET_ENV, make_hello, verify_welcome
from mstar_core.wire.batch import join_messages
from mstar_core.wire.curve import client_keys
from mstar_core.wire.session import Channel

log = logging.getLogger("mstar.worker")

TO_SERVER = "a message to the server"  # what a failed unawaited send logs
_SEND_FAILED = log_send_failure(TO_SERVER)


class CoordinatorLink:
    """The worker's socket to the serving process, its session once welcomed, and the data link the Welcome names."""

    def __init__(self, name: str, join: str, secret: bytes, encrypt: bool):
        self.name = name
        self.join = join
        self.secret = secret
        self.encrypt = encrypt
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.link: Any = None  # this end of the worker link, over the transport the Welcome names
        self.channel: Channel | None = None  # the authenticated session, once welcomed
        self.heartbeat_interval = 0.5
        self._outbox: list[list] | None = None  # messages `send_soon` queued this turn of the event loop
        self.refusals = RefusalLog(log)

    async def connect(self, registry: Any) -> None:
        """Say Hello, wait for the Welcome, open the data link and the session (SystemExit when nobody answers)."""
        loop = asyncio.get_running_loop()
        if self.encrypt:
            client_keys(self.sock, self.secret)
        self.sock.connect(self.join)
        hello = make_hello(self.secret, self.name)
        await self.send(hello)
        try:
            welcome = await self.recv(timeout=float(os.environ.get("MSTAR_JOIN_TIMEOUT", "15")))
        except TimeoutError:
            how = "encrypted" if self.encrypt else "unencrypted"
            raise SystemExit(f"worker {self.name}: no answer from {self.join} ({how}; wrong address, wrong "
                             f"{SECRET_ENV}, or a server that {'does not encrypt' if self.encrypt else 'encrypts'} "
                             f"(--encrypt)?)") from None
        verify_welcome(self.secret, hello, welcome)
        self.link = open_link(registry, welcome.transport, "worker")
        self.link.peer_joined({"control": self.join})
        self.link.on_failure = lambda why: loop.call_soon_threadsafe(self._link_failed, why)
        self.channel = Channel.for_worker(self.secret, hello.nonce, welcome.session)
        self.heartbeat_interval = welcome.heartbeat_interval

    def _link_failed(self, why: str) -> None:
        # nothing more reaches us over the link and a group's threads cannot be unblocked: leave, be replaced
        log.error("worker %s: its %s link broke (%s); exiting so the server replaces it", self.name,
                  self.link.name if self.link else "?", why)
        os._exit(3)

    def send_soon(self, msg: Any) -> None:
        """Send without waiting, strictly after everything sent before it (loop values, then done).

        The message is encoded here, not in the background: a value that cannot travel raises in
        the caller (a delegated loop then fails its request) instead of vanishing unsent. It goes
        out at the end of this turn of the event loop, with every other message sent this way in
        the meantime, as one sealed message (`wire.batch`).
        """
        frames = self._encode(msg)
        if self.channel is None:  # not welcomed yet (nothing sends this way before): no session to seal with
            self.sock.send_multipart(frames, copy=False).add_done_callback(_SEND_FAILED)
            return
        if self._outbox is None:
            self._outbox = []
            asyncio.get_running_loop().call_soon(self._flush_outbox)
        self._outbox.extend(self._packed(frames))

    async def send(self, msg: Any) -> None:
        await self._send_frames(self._encode(msg))

    def _encode(self, msg: Any) -> list:
        # device tensors stay on the device when the link moves them itself (NCCL)
        return encode(msg, keep_device=self.link is not None and self.channel is not None and self.link.keep_device)

    def _packed(self, frames: list) -> list[list]:
        """A message as the link sends it, after what the link has for the server's end (e.g. shm slots released)."""
        if self.link is None:
            return [frames]
        packed = self.link.pack(frames)
        ctl = self.link.control()
        return [packed] if ctl is None else [ctl, packed]

    def _flush_outbox(self) -> None:
        pending, self._outbox = self._outbox, None
        if pending and self.channel is not None:
            send_sealed(self.sock, self.channel, join_messages(pending), unawaited=TO_SERVER)

    def _send_frames(self, frames: list) -> asyncio.Future:
        # sealing and handing to the socket happen in one go: sequence numbers go out in order
        if self.channel is None:  # only the Hello goes out before the session exists
            return self.sock.send_multipart(frames, copy=False)
        self._flush_outbox()  # what `send_soon` queued goes first
        return send_sealed(self.sock, self.channel, join_messages(self._packed(frames)))

    async def recv(self, timeout: float | None = None) -> Any:
        """The next message from the coordinator; anything not sealed for our session is dropped (and logged)."""
        while True:
            frames = [f.buffer for f in await asyncio.wait_for(self.sock.recv_multipart(copy=False), timeout)]
            try:
                if self.channel is not None:
                    frames = self.channel.open(frames)
                if self.link is not None and self.channel is not None:
                    frames = self.link.unpack(frames)
                    if frames is None:
                        continue  # a message for the link itself (e.g. shm slots released, segments mapped)
                    if isinstance(frames, concurrent.futures.Future):  # big frames still arriving over the link
                        frames = await asyncio.wrap_future(frames)
                return decode(frames)
            except WireError as exc:  # AuthError included
                if self.channel is None:
                    raise
                self.refusals.refuse("recv", "worker %s: dropped a message from the coordinator: %s", self.name, exc)

    def close_socket(self) -> None:
        self.sock.close(0)
        self.ctx.term()

    def close_link(self) -> None:
        if self.link is not None:
            self.link.close()
