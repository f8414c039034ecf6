"""A worker's direct line to other workers: request state moved between them, and stream items.

Each worker binds one ROUTER socket (loopback, or its address towards the server when it joined
from another host, then CURVE-encrypted like the control link) and reports its address in its
heartbeats. To move a request's state from worker a to worker b (the per-walk KV move), the server
picks a fresh nonce and session id and tells both, sealed on their control links; a seals the
state with keys derived from the shared secret and that nonce (`wire.session.Channel`) and sends
it to b, which opens it and hands it to its import: the serving process sees only the two control
messages. A session id is accepted once; state that arrives before b's import asks for it waits
(a bounded number of moves).

A stream whose producer and consumer run on two workers uses the same line: `StreamOutbox`
(stream_outbox.py) seals, batches and sends its items on credit; `StreamInbox` (stream_inbox.py)
opens them in order, hands them to their consumer and sends the credits back. An item is tagged
`s` + nonce in its first frame; a move is tagged with its nonce (hex: never starts with `s`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from mstar_core.cluster import stream_inbox, stream_outbox
from mstar_core.cluster.sealed import send_sealed
from mstar_core.cluster.stream_inbox import StreamInbox
from mstar_core.cluster.stream_outbox import StreamOutbox
from mstar_core.wire.batch import split_messages
from mstar_core.wire.curve import client_keys, needs_encryption, server_keys, start_asyncio_authenticator
from mstar_core.wire.errors import WireError
from mstar_core.wire.session import Channel, session_of
from mstar_core.wire.transport import frames_bytes

log = logging.getLogger("mstar.links")


class PeerMailbox:
    """The peer line's sockets and receive loop, the moves through it, and its two stream ends."""

    #: moves whose state may wait for their import at once (more: the oldest is dropped)
    MAX_WAITING = 64
    MAX_STREAMS = stream_inbox.MAX_STREAMS
    MAX_EARLY_ITEMS = stream_inbox.MAX_EARLY_ITEMS
    ENDED = stream_inbox.ENDED
    STREAM_WINDOW = stream_outbox.STREAM_WINDOW
    ACK_EVERY = stream_outbox.ACK_EVERY

    def __init__(self, secret: bytes, host: str = "127.0.0.1", encrypt: bool = False):
        self.secret, self.encrypt = secret, encrypt
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self._auth = None
        if encrypt:
            self._auth = start_asyncio_authenticator(self.ctx, secret)
            server_keys(self.sock, secret)
        self.sock.bind(f"tcp://{host}:0")
        self.address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._out: dict[str, Any] = {}
        self._arrived: collections.OrderedDict[bytes, list[Any]] = collections.OrderedDict()
        self._waiting: dict[bytes, asyncio.Future] = {}
        self._used: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.sent_bytes = self.received_bytes = 0
        self.sent_moves = self.received_moves = 0
        self._refused = 0  # messages off the line that were refused
        self.streams_in = StreamInbox(secret, self.sock)
        self.streams_out = StreamOutbox(secret, self._socket)
        self._task = asyncio.ensure_future(self._receive())

    @property
    def refused(self) -> int:
        """What was refused: messages off the line, and credit reports that were not one."""
        return self._refused + self.streams_out.refused

    def stats(self) -> dict[str, Any]:
        inbox, outbox = self.streams_in, self.streams_out
        return {"address": self.address, "sent_bytes": self.sent_bytes, "received_bytes": self.received_bytes,
                "sent_moves": self.sent_moves, "received_moves": self.received_moves, "refused": self.refused,
                "stream_sent_bytes": outbox.sent_bytes, "stream_received_bytes": inbox.received_bytes,
                "stream_sent_items": outbox.sent_items, "stream_received_items": inbox.received_items,
                "stream_late_items": inbox.late_items, "streams_open": inbox.open_count(),
                "stream_messages_sent": outbox.messages_sent, "stream_acks_sent": inbox.acks_sent,
                "streams_waiting_for_credit": outbox.waiting()}

    def _socket(self, address: str) -> Any:
        sock = self._out.get(address)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            # by the receiver's address, as it chose (a worker joined over loopback may send to one that joined
            # from another host, and the other way round)
            if needs_encryption(address):
                client_keys(sock, self.secret)
            sock.connect(address)
            self._out[address] = sock
            self.streams_out.read_credits(sock)
        return sock

    # -- moves -------------------------------------------------------------------------------------

    async def send(self, address: str, nonce: str, session: str, frames: list[Any]) -> None:
        """Seal `frames` for move (`nonce`, `session`) and send them to the worker at `address`."""
        sock = self._socket(address)
        self.sent_bytes += frames_bytes(frames)
        self.sent_moves += 1
        await send_sealed(sock, Channel.for_worker(self.secret, nonce, session), frames, head=(nonce.encode(),))

    def expect(self, session: str) -> asyncio.Future:
        """The frames of move `session`, when they arrive (at once if they already did)."""
        key = bytes.fromhex(session)
        future = asyncio.get_running_loop().create_future()
        frames = self._arrived.pop(key, None)
        if frames is not None:
            future.set_result(frames)
        else:
            self._waiting[key] = future
            future.add_done_callback(lambda f, k=key: self._waiting.pop(k, None))
        return future

    def _on_move(self, nonce: str, body: list[Any]) -> None:
        session = session_of(body)
        if session is None or session in self._used:
            raise WireError("not a sealed move, or one already received")
        frames = Channel.for_coordinator(self.secret, nonce, session.hex()).open(body)
        self._used[session] = None
        while len(self._used) > 16 * self.MAX_WAITING:
            self._used.popitem(last=False)
        self.received_bytes += frames_bytes(frames)
        self.received_moves += 1
        waiting = self._waiting.pop(session, None)
        if waiting is not None and not waiting.done():
            waiting.set_result(frames)
            return
        self._arrived[session] = frames
        while len(self._arrived) > self.MAX_WAITING:
            self._arrived.popitem(last=False)

    # -- streams (see StreamOutbox and StreamInbox) --------------------------------------------------

    def stream_channel(self, nonce: str, session: str, start: int) -> Any:
        return self.streams_out.channel(nonce, session, start)

    def send_stream(self, address: str, nonce: str, channel: Any, frames: list[Any]) -> None:
        self.streams_out.send(address, nonce, channel, frames)

    async def stream_credit(self, session: str, channel: Any) -> None:
        await self.streams_out.credit(session, channel)

    def forget_credit(self, session: str) -> None:
        self.streams_out.forget(session)

    def accept_stream(self, session: str, nonce: str, deliver: Callable[[list[Any]], None]) -> None:
        self.streams_in.accept(session, nonce, deliver)

    def ack_stream(self, session: str, taken: int) -> None:
        self.streams_in.ack(session, taken)

    def drop_stream(self, session: str) -> None:
        self.streams_in.drop(session)

    # -- receiving -----------------------------------------------------------------------------------

    async def _receive(self) -> None:
        handled = 0
        while True:
            handled += 1
            if handled % 16 == 0:
                # a receive that finds a message waiting does not yield: a backlog of stream items would
                # otherwise keep this worker's event loop (its heartbeats too) busy until it is drained
                await asyncio.sleep(0)
            try:
                raw = await self.sock.recv_multipart(copy=False)
            except asyncio.CancelledError:
                raise
            except Exception:  # the context is closing
                return
            sender = raw[0].bytes
            try:
                messages = split_messages([f.buffer for f in raw[1:]])  # raw[0]: the sender's routing id
            except WireError as exc:
                self._refused += 1
                log.warning("peer mailbox %s: dropped a message: %s", self.address, exc)
                continue
            for message in messages:  # a bad one is refused alone: the others still reach their streams
                try:
                    self._on_message(message, sender)
                except (IndexError, UnicodeDecodeError, ValueError, WireError) as exc:  # AuthError is a WireError
                    self._refused += 1
                    log.warning("peer mailbox %s: dropped a message: %s", self.address, exc)

    def _on_message(self, message: list[Any], sender: bytes = b"") -> None:
        """One message off the peer line: [tag, sealed frames...]; tag `s` + nonce for a stream item, else a move's nonce."""
        head = bytes(message[0])
        nonce = head.decode("ascii")
        body = list(message[1:])
        if head[:1] == b"s":  # a stream item (a move's nonce is hex: never starts with 's')
            self.streams_in.on_item(nonce[1:], body, sender)
        else:
            self._on_move(nonce, body)

    def close(self) -> None:
        self.streams_in.close()
        self._task.cancel()
        self.streams_out.close()
        for sock in self._out.values():
            sock.close(0)
        self.sock.close(0)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()
