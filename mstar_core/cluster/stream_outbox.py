"""The sending end of streams on a worker's peer line: items sealed in order, batched per receiver, sent on credit.

The items sealed for one worker in one turn of the event loop (a decode step's token for each of
its streams) travel as one message (`wire.batch`): per-message costs are paid once per step, not
once per stream. A producer waits (`credit`) while `STREAM_WINDOW` items it sent are not taken by
the consumer yet, so one far ahead of a slow consumer holds a bounded number in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from mstar_core.cluster.sealed import log_send_failure
from mstar_core.wire.batch import join_messages
from mstar_core.wire.session import Channel
from mstar_core.wire.transport import frames_bytes

#: items of one stream sent and not yet taken by its consumer before its producer waits for a credit
STREAM_WINDOW = 128
#: a consumer reports progress once it has taken this many items since its last report
ACK_EVERY = STREAM_WINDOW // 4

_STREAM_SEND = log_send_failure("peer line: a stream message")


class StreamOutbox:
    """Streams this worker produces for others: items waiting for this turn's send, and each stream's credit."""

    def __init__(self, secret: bytes, socket_for: Callable[[str], Any]):
        self.secret = secret
        self._socket_for = socket_for  # the mailbox's connection to the worker at an address
        # stream items sealed this turn of the event loop and not yet handed to the socket, per receiver
        self._pending: dict[str, list[tuple[bytes, list[Any]]]] = {}
        self.sent_bytes = self.sent_items = 0
        self.messages_sent = 0  # socket messages that carried those items (several a message: `_flush`)
        # stream session -> items its consumer has taken, and who waits for more
        self._taken: dict[bytes, int] = {}
        self._credit: dict[bytes, asyncio.Future] = {}
        self._credit_readers: set[asyncio.Task] = set()
        self.refused = 0  # credit reports that were not one
        self._closed = False

    def channel(self, nonce: str, session: str, start: int) -> Any:
        """The sealing end of stream (`nonce`, `session`) whose first `start` items went out earlier (another loop run)."""
        channel = Channel.for_worker(self.secret, nonce, session)
        channel._sent = start  # item i is sealed with sequence i + 1 whichever run sends it: the consumer sees one order
        return channel

    def send(self, address: str, nonce: str, channel: Any, frames: list[Any]) -> None:
        """Seal one stream item and send it at the end of this turn, after every item sent before it (never waits)."""
        sealed = channel.seal(frames)
        self.sent_bytes += frames_bytes(frames)
        self.sent_items += 1
        pending = self._pending.get(address)
        if pending is None:
            pending = self._pending[address] = []
            asyncio.get_running_loop().call_soon(self._flush, address)
        pending.append((nonce.encode(), sealed))

    def _flush(self, address: str) -> None:
        """Send the items sealed for `address` this turn, as one message (`wire.batch`)."""
        pending = self._pending.pop(address, None)
        if not pending or self._closed:  # closed meanwhile: the receiver's streams fail with this worker
            return
        self.messages_sent += 1
        message = join_messages([[b"s" + nonce, *sealed] for nonce, sealed in pending])
        self._socket_for(address).send_multipart(message, copy=False).add_done_callback(_STREAM_SEND)

    async def credit(self, session: str, channel: Any) -> None:
        """Wait while `STREAM_WINDOW` items sealed on `channel` (stream `session`) are not taken by its consumer yet."""
        key = bytes.fromhex(session)
        while channel._sent - self._taken.get(key, 0) >= STREAM_WINDOW and not self._closed:
            waiter = self._credit.get(key)
            if waiter is None or waiter.done():
                waiter = self._credit[key] = asyncio.get_running_loop().create_future()
            await waiter

    def forget(self, session: str) -> None:
        """The producer's side of stream `session` is done (its request released)."""
        key = bytes.fromhex(session)
        self._taken.pop(key, None)
        waiter = self._credit.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.cancel()

    def waiting(self) -> int:
        """Streams whose producer waits for a credit now."""
        return sum(1 for w in self._credit.values() if not w.done())

    def read_credits(self, sock: Any) -> None:
        """Read the credits that come back on a new connection to a receiver (until it closes)."""
        reader = asyncio.ensure_future(self._read_credits(sock))
        self._credit_readers.add(reader)
        reader.add_done_callback(self._credit_readers.discard)

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

    def close(self) -> None:
        self._closed = True
        for reader in list(self._credit_readers):
            reader.cancel()
        for waiter in self._credit.values():
            if not waiter.done():
                waiter.cancel()
        self._pending.clear()
