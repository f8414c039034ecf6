"""Worker links through the plugin registry: the transport a placement names carries a worker's tensors.

The core imports no transport plugin: it looks the name up in the registry (`mstar_register_transports`)
and asks the class for one end of a worker link (`Transport.worker_link`). Control messages always
travel on the ZeroMQ control socket, which the core owns; so `zmq`, the default, needs no plugin to
mean "every frame on that socket" when the zmq plugin is not loaded (`MSTAR_PLUGINS` left it out).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
from collections.abc import Callable, Mapping
from typing import Any

from mstar_core.cluster.sealed import log_send_failure, send_sealed
from mstar_core.config.placement import Placement
from mstar_core.errors import ConfigError
from mstar_core.wire.curve import needs_encryption
from mstar_core.wire.errors import TransportError
from mstar_core.wire.transport import InlineLink, Transport, TransportLink

log = logging.getLogger("mstar.links")

#: The transport of workers whose placement names none.
DEFAULT_TRANSPORT = "zmq"


def carries_worker_links(cls: Any) -> bool:
    """True when a registered transport class can make worker links (overrides `Transport.worker_link`)."""
    method = getattr(cls, "worker_link", None)
    return method is not None and getattr(method, "__func__", None) is not Transport.worker_link.__func__


def link_transport(registry: Any, name: str) -> Any:
    """The registered class of transport `name`, or None for the built-in inline `zmq` link; ConfigError if unusable."""
    if name == DEFAULT_TRANSPORT and name not in registry.transports:
        return None
    if name not in registry.transports:
        known = sorted({*registry.transports, DEFAULT_TRANSPORT})
        raise ConfigError(f"unknown transport '{name}'; known: {', '.join(known)} (install the plugin that "
                          f"registers it, or check MSTAR_PLUGINS)")
    cls = registry.transports.get(name)
    if not carries_worker_links(cls):
        usable = sorted({n for n, c in registry.transports.items() if carries_worker_links(c)} | {DEFAULT_TRANSPORT})
        raise ConfigError(f"transport '{name}' cannot carry a worker's tensors; use one of: {', '.join(usable)}")
    return cls


def check_transports(placement: Placement, registry: Any) -> None:
    """Every worker's transport in `placement` is registered, can carry a worker's tensors, and suits its launcher."""
    remote = placement.bind is not None and needs_encryption(placement.bind)
    for name, spec in placement.workers.items():
        where = f"{placement.source}: workers.{name}.transport"
        try:
            cls = link_transport(registry, spec.transport)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        options = dict(spec.transport_options)
        if cls is None and options:
            raise ConfigError(f"{where}: transport '{spec.transport}' takes no options")
        if cls is not None:
            try:
                cls.check_link_options(options, remote=remote)
            except TransportError as exc:
                raise ConfigError(f"{where}: {exc}") from None
        if getattr(cls, "same_host", False) and spec.launcher != "spawn":
            raise ConfigError(f"{where}: {spec.transport} needs a worker spawned on this host (launcher: spawn), "
                              f"not launcher: {spec.launcher}")


def open_link(registry: Any, name: str, role: str, options: Mapping[str, Any] | None = None) -> TransportLink:
    """One end (`role` 'server' or 'worker') of a worker link over transport `name` (with placement's options)."""
    cls = link_transport(registry, name)
    if cls is None:
        return InlineLink(DEFAULT_TRANSPORT)
    return cls.worker_link(role, **options) if options else cls.worker_link(role)


class OrderedInbox:
    """Delivers one link's messages in arrival order without blocking the event loop on frames still arriving.

    `put` takes what `TransportLink.unpack` returned: frames are delivered at once when nothing of
    this link waits before them; a future (frames a process group is still receiving) and whatever
    comes after it wait in line, drained by a task, so other links' messages go on meanwhile.
    A future that fails drops its message (`on_error` says why); the next ones are still delivered.
    """

    def __init__(self, deliver: Callable[[list[Any]], None], on_error: Callable[[BaseException], None]):
        self._deliver = deliver
        self._on_error = on_error
        self._queue: collections.deque[Any] = collections.deque()
        self._task: asyncio.Task | None = None

    def put(self, item: list[Any] | concurrent.futures.Future) -> None:
        if not self._queue and not isinstance(item, concurrent.futures.Future):
            self._deliver(item)
            return
        self._queue.append(item)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        while self._queue:
            item = self._queue[0]
            if isinstance(item, concurrent.futures.Future):
                try:
                    item = await asyncio.wrap_future(item)
                except asyncio.CancelledError:
                    if not item.cancelled():
                        raise  # the drain itself was cancelled (clear)
                    item = None
                except Exception as exc:
                    self._on_error(exc)
                    item = None
            self._queue.popleft()
            if item is not None:
                try:
                    self._deliver(item)
                except Exception:  # one message's handling must not stop the link's delivery
                    log.exception("delivering a message from a worker link failed")

    def clear(self) -> None:
        """Drop everything waiting (the peer is gone)."""
        self._queue.clear()
        if self._task is not None:
            self._task.cancel()
            self._task = None


class PeerMailbox:
    """A worker's direct line to other workers, for request state that moves between them (the per-walk KV move).

    Each worker binds one ROUTER socket (loopback, or its address towards the server when it joined
    from another host, then CURVE-encrypted like the control link) and reports its address in its
    heartbeats. To move a request's state from worker a to worker b, the server picks a fresh nonce
    and session id and tells both, sealed on their control links; a seals the state with keys derived
    from the shared secret and that nonce (`wire.session.Channel`) and sends it to b, which opens it
    and hands it to its import: the serving process sees only the two control messages. A session id
    is accepted once; state that arrives before b's import asks for it waits (a bounded number of moves).

    A stream whose producer and consumer run on two workers uses the same line: every item is sealed
    on the stream's own session (sequence numbers in order, so none is replayed or reordered
    unnoticed); the consumer's worker hands them to the stream it registered (`accept_stream`),
    keeping those that come before it did (bounded). An item is tagged `s` + nonce in its first
    frame; the items sent to one worker in one turn of the event loop (a decode step's token for
    each of its streams) travel as one message (`wire.batch`).

    Streams are credited: the consumer's worker reports, back down the same connection, how many
    of a stream's items it has taken off the line (`ack_stream`: those its consumer took or its
    chunk policy holds); the producer's run waits (`stream_credit`) while `STREAM_WINDOW` items it
    sent are not taken yet. A producer far ahead of a slow consumer therefore holds at most that
    many items in flight and waiting per stream, instead of buffering without bound.
    """

    #: moves whose state may wait for their import at once (more: the oldest is dropped)
    MAX_WAITING = 64
    #: streams open at once on this mailbox, and items one may hold before its consumer registers
    MAX_STREAMS = 1024
    MAX_EARLY_ITEMS = 65536
    #: items of one stream sent and not yet taken by its consumer before its producer waits for a credit
    STREAM_WINDOW = 128
    #: a consumer reports progress once it has taken this many items since its last report
    ACK_EVERY = STREAM_WINDOW // 4
    #: the credit that ends a stream's accounting (its consumer ended: the producer never waits on it again)
    ENDED = 1 << 62

    def __init__(self, secret: bytes, host: str = "127.0.0.1", encrypt: bool = False):
        import zmq
        import zmq.asyncio

        from mstar_core.wire.curve import server_keys, start_asyncio_authenticator

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
        self.stream_sent_bytes = self.stream_received_bytes = 0
        self.stream_sent_items = self.stream_received_items = self.stream_late_items = 0
        self.stream_acks_sent = 0
        self.refused = 0
        # stream session -> [channel, nonce, deliver (None until accepted), items that came before, sender's routing id]
        self._streams: dict[bytes, list[Any]] = {}
        # ended stream sessions -> the sender's routing id until it was told the stream ended (then None)
        self._ended: collections.OrderedDict[bytes, bytes | None] = collections.OrderedDict()
        # the producer's side of the credits: stream session -> items its consumer has taken, and who waits for more
        self._taken: dict[bytes, int] = {}
        self._credit: dict[bytes, asyncio.Future] = {}
        self._credit_readers: set[asyncio.Task] = set()
        # stream items sealed this turn of the event loop and not yet handed to the socket, per receiver
        self._outbox: dict[str, list[tuple[bytes, list[Any]]]] = {}
        self.stream_messages_sent = 0  # socket messages that carried those items (several a message: `_flush`)
        self._closed = False
        self._task = asyncio.ensure_future(self._receive())

    def stats(self) -> dict[str, Any]:
        return {"address": self.address, "sent_bytes": self.sent_bytes, "received_bytes": self.received_bytes,
                "sent_moves": self.sent_moves, "received_moves": self.received_moves, "refused": self.refused,
                "stream_sent_bytes": self.stream_sent_bytes, "stream_received_bytes": self.stream_received_bytes,
                "stream_sent_items": self.stream_sent_items, "stream_received_items": self.stream_received_items,
                "stream_late_items": self.stream_late_items, "streams_open": len(self._streams),
                "stream_messages_sent": self.stream_messages_sent, "stream_acks_sent": self.stream_acks_sent,
                "streams_waiting_for_credit": sum(1 for w in self._credit.values() if not w.done())}

    def _socket(self, address: str) -> Any:
        import zmq

        from mstar_core.wire.curve import client_keys, needs_encryption

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
            reader = asyncio.ensure_future(self._read_credits(sock))
            self._credit_readers.add(reader)
            reader.add_done_callback(self._credit_readers.discard)
        return sock

    async def send(self, address: str, nonce: str, session: str, frames: list[Any]) -> None:
        """Seal `frames` for move (`nonce`, `session`) and send them to the worker at `address`."""
        from mstar_core.wire.session import Channel
        from mstar_core.wire.transport import frames_bytes

        sock = self._socket(address)
        self.sent_bytes += frames_bytes(frames)
        self.sent_moves += 1
        await send_sealed(sock, Channel.for_worker(self.secret, nonce, session), frames, head=(nonce.encode(),))

    # -- streams -----------------------------------------------------------------------------------

    def stream_channel(self, nonce: str, session: str, start: int) -> Any:
        """The sealing end of stream (`nonce`, `session`) whose first `start` items went out earlier (another loop run)."""
        from mstar_core.wire.session import Channel

        channel = Channel.for_worker(self.secret, nonce, session)
        channel._sent = start  # item i is sealed with sequence i + 1 whichever run sends it: the consumer sees one order
        return channel

    def send_stream(self, address: str, nonce: str, channel: Any, frames: list[Any]) -> None:
        """Seal one stream item and send it, after every item sent before it (never waits: the producer goes on).

        The item goes out at the end of this turn of the event loop, with every other item sealed
        for the same worker in the meantime: per-message costs (the socket, the receiver's wake-up)
        are paid once per decode step instead of once per stream.
        """
        from mstar_core.wire.transport import frames_bytes

        sealed = channel.seal(frames)
        self.stream_sent_bytes += frames_bytes(frames)
        self.stream_sent_items += 1
        pending = self._outbox.get(address)
        if pending is None:
            pending = self._outbox[address] = []
            asyncio.get_running_loop().call_soon(self._flush, address)
        pending.append((nonce.encode(), sealed))

    def _flush(self, address: str) -> None:
        """Send the items sealed for `address` this turn, as one message (`wire.batch`)."""
        from mstar_core.wire.batch import join_messages

        pending = self._outbox.pop(address, None)
        if not pending or self._closed:  # closed meanwhile: the receiver's streams fail with this worker
            return
        self.stream_messages_sent += 1
        message = join_messages([[b"s" + nonce, *sealed] for nonce, sealed in pending])
        self._socket(address).send_multipart(message, copy=False).add_done_callback(_STREAM_SEND)

    async def stream_credit(self, session: str, channel: Any) -> None:
        """Wait while `STREAM_WINDOW` items sealed on `channel` (stream `session`) are not taken by its consumer yet."""
        key = bytes.fromhex(session)
        while channel._sent - self._taken.get(key, 0) >= self.STREAM_WINDOW and not self._closed:
            waiter = self._credit.get(key)
            if waiter is None or waiter.done():
                waiter = self._credit[key] = asyncio.get_running_loop().create_future()
            await waiter

    def forget_credit(self, session: str) -> None:
        """The producer's side of stream `session` is done (its request released)."""
        key = bytes.fromhex(session)
        self._taken.pop(key, None)
        waiter = self._credit.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.cancel()

    async def _read_credits(self, sock: Any) -> None:
        """Credits coming back from a receiver: [b"c", session, items taken (8 bytes, big-endian)]."""
        while True:
            try:
                frames = await sock.recv_multipart()
            except asyncio.CancelledError:
                raise
            except Exception:  # the socket or the context is closing
                return
            if len(frames) != 3 or frames[0] != b"c" or len(frames[2]) != 8:
                self.refused += 1
                continue
            key, taken = bytes(frames[1]), int.from_bytes(frames[2], "big")
            if taken <= self._taken.get(key, 0):
                continue  # reports can only grow; an old one changes nothing
            self._taken[key] = taken
            waiter = self._credit.pop(key, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def ack_stream(self, session: str, taken: int) -> None:
        """Tell stream `session`'s producer that `taken` of its items are off the line (its consumer took them)."""
        entry = self._streams.get(bytes.fromhex(session))
        if entry is not None and entry[4] is not None:
            self._send_credit(entry[4], bytes.fromhex(session), taken)

    def _send_credit(self, routing_id: bytes, key: bytes, taken: int) -> None:
        if self._closed:
            return
        self.stream_acks_sent += 1
        self.sock.send_multipart([routing_id, b"c", key, taken.to_bytes(8, "big")],
                                 copy=False).add_done_callback(_CREDIT_SEND)

    def accept_stream(self, session: str, nonce: str, deliver: Callable[[list[Any]], None]) -> None:
        """Hand stream `session`'s items to `deliver`, in order: at once those already here, then as they come."""
        from mstar_core.wire.session import Channel

        key = bytes.fromhex(session)
        entry = self._streams.get(key)
        if entry is None or entry[1] != nonce:  # early items sealed under another nonce are not this stream's
            entry = self._streams[key] = [Channel.for_coordinator(self.secret, nonce, session), nonce, None, [], None]
        early, entry[3] = entry[3], []
        entry[2] = deliver
        for frames in early:
            deliver(frames)

    def drop_stream(self, session: str) -> None:
        """The consumer is done (or released): later items of this stream are dropped."""
        key = bytes.fromhex(session)
        entry = self._streams.pop(key, None)
        sender = entry[4] if entry is not None else None
        if sender is not None:  # its producer must never wait on this stream again (it may still be producing)
            self._send_credit(sender, key, self.ENDED)
        self._ended[key] = None if sender is not None else b""
        while len(self._ended) > self.MAX_STREAMS:
            self._ended.popitem(last=False)

    def _on_stream_item(self, nonce: str, body: list[Any], sender: bytes = b"") -> None:
        from mstar_core.wire.errors import WireError
        from mstar_core.wire.session import Channel, session_of
        from mstar_core.wire.transport import frames_bytes

        session = session_of(body)
        if session is None:
            raise WireError("not a sealed stream item")
        if session in self._ended:  # still in flight when its consumer ended (a cancelled request): nothing to do
            self.stream_late_items += 1
            if self._ended[session] == b"" and sender:  # ended before any item came: release its producer once
                self._ended[session] = None
                self._send_credit(sender, session, self.ENDED)
            return
        entry = self._streams.get(session)
        made = entry is None
        if made:
            if len(self._streams) >= self.MAX_STREAMS:
                raise WireError("too many open streams")
            entry = [Channel.for_coordinator(self.secret, nonce, session.hex()), nonce, None, [], None]
        frames = entry[0].open(body)  # AuthError (a WireError) when forged, replayed or out of order
        if made:
            self._streams[session] = entry
        if sender:
            entry[4] = sender  # where its credits go: the connection its (authenticated) items come on
        self.stream_received_bytes += frames_bytes(frames)
        self.stream_received_items += 1
        if entry[2] is not None:
            entry[2](frames)
        elif len(entry[3]) < self.MAX_EARLY_ITEMS:
            entry[3].append(frames)
        else:
            raise WireError("a stream's consumer did not register in time; item dropped")

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

    async def _receive(self) -> None:
        from mstar_core.wire.batch import split_messages
        from mstar_core.wire.errors import WireError

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
                self.refused += 1
                log.warning("peer mailbox %s: dropped a message: %s", self.address, exc)
                continue
            for message in messages:  # a bad one is refused alone: the others still reach their streams
                try:
                    self._on_message(message, sender)
                except (IndexError, UnicodeDecodeError, ValueError, WireError) as exc:  # AuthError is a WireError
                    self.refused += 1
                    log.warning("peer mailbox %s: dropped a message: %s", self.address, exc)

    def _on_message(self, message: list[Any], sender: bytes = b"") -> None:
        """One message off the peer line: [tag, sealed frames...]; tag `s` + nonce for a stream item, else a move's nonce."""
        from mstar_core.wire.errors import WireError
        from mstar_core.wire.session import Channel, session_of
        from mstar_core.wire.transport import frames_bytes

        head = bytes(message[0])
        nonce = head.decode("ascii")
        body = list(message[1:])
        if head[:1] == b"s":  # a stream item (a move's nonce is hex: never starts with 's')
            self._on_stream_item(nonce[1:], body, sender)
            return
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

    def close(self) -> None:
        self._closed = True
        self._task.cancel()
        for reader in list(self._credit_readers):
            reader.cancel()
        for waiter in self._credit.values():
            if not waiter.done():
                waiter.cancel()
        self._outbox.clear()
        for sock in self._out.values():
            sock.close(0)
        self.sock.close(0)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()


_STREAM_SEND = log_send_failure("peer line: a stream message")
_CREDIT_SEND = log_send_failure("peer line: a stream credit")
