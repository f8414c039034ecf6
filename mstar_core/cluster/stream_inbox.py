"""The receiving end of streams on a worker's peer line: items opened in order, handed to their consumer, credited.

Every item of a stream is sealed on the stream's own session (sequence numbers in order, so none
is replayed or reordered unnoticed). The consumer's worker hands them to the stream it registered
(`accept`), keeping those that come before it did (bounded), and reports back down the same
connection how many of a stream's items it has taken off the line (`ack`): the producer's credits.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from mstar_core.cluster.sealed import log_send_failure
from mstar_core.wire.errors import WireError
from mstar_core.wire.session import Channel, session_of
from mstar_core.wire.transport import frames_bytes

#: streams open at once on one mailbox, and items one may hold before its consumer registers
MAX_STREAMS = 1024
MAX_EARLY_ITEMS = 65536
#: the credit that ends a stream's accounting (its consumer ended: the producer never waits on it again)
ENDED = 1 << 62

_CREDIT_SEND = log_send_failure("peer line: a stream credit")


class StreamInbox:
    """Streams whose items come to this worker: their sessions, their consumers, and where their credits go."""

    def __init__(self, secret: bytes, sock: Any):
        self.secret = secret
        self.sock = sock  # the mailbox's ROUTER: credits go back on the connection the items came on
        # stream session -> [channel, nonce, deliver (None until accepted), items that came before, sender's routing id]
        self._streams: dict[bytes, list[Any]] = {}
        # ended stream sessions -> the sender's routing id until it was told the stream ended (then None)
        self._ended: collections.OrderedDict[bytes, bytes | None] = collections.OrderedDict()
        self.received_bytes = self.received_items = self.late_items = 0
        self.acks_sent = 0
        self._closed = False

    def open_count(self) -> int:
        return len(self._streams)

    def accept(self, session: str, nonce: str, deliver: Callable[[list[Any]], None]) -> None:
        """Hand stream `session`'s items to `deliver`, in order: at once those already here, then as they come."""
        key = bytes.fromhex(session)
        entry = self._streams.get(key)
        if entry is None or entry[1] != nonce:  # early items sealed under another nonce are not this stream's
            entry = self._streams[key] = [Channel.for_coordinator(self.secret, nonce, session), nonce, None, [], None]
        early, entry[3] = entry[3], []
        entry[2] = deliver
        for frames in early:
            deliver(frames)

    def ack(self, session: str, taken: int) -> None:
        """Tell stream `session`'s producer that `taken` of its items are off the line (its consumer took them)."""
        entry = self._streams.get(bytes.fromhex(session))
        if entry is not None and entry[4] is not None:
            self._send_credit(entry[4], bytes.fromhex(session), taken)

    def _send_credit(self, routing_id: bytes, key: bytes, taken: int) -> None:
        if self._closed:
            return
        self.acks_sent += 1
        self.sock.send_multipart([routing_id, b"c", key, taken.to_bytes(8, "big")],
                                 copy=False).add_done_callback(_CREDIT_SEND)

    def drop(self, session: str) -> None:
        """The consumer is done (or released): later items of this stream are dropped."""
        key = bytes.fromhex(session)
        entry = self._streams.pop(key, None)
        sender = entry[4] if entry is not None else None
        if sender is not None:  # its producer must never wait on this stream again (it may still be producing)
            self._send_credit(sender, key, ENDED)
        self._ended[key] = None if sender is not None else b""
        while len(self._ended) > MAX_STREAMS:
            self._ended.popitem(last=False)

    def on_item(self, nonce: str, body: list[Any], sender: bytes = b"") -> None:
        """One sealed item from `sender`; a WireError (forged, replayed, out of order, too many) refuses it."""
        session = session_of(body)
        if session is None:
            raise WireError("not a sealed stream item")
        if session in self._ended:  # still in flight when its consumer ended (a cancelled request): nothing to do
            self.late_items += 1
            if self._ended[session] == b"" and sender:  # ended before any item came: release its producer once
                self._ended[session] = None
                self._send_credit(sender, session, ENDED)
            return
        entry = self._streams.get(session)
        made = entry is None
        if made:
            if len(self._streams) >= MAX_STREAMS:
                raise WireError("too many open streams")
            entry = [Channel.for_coordinator(self.secret, nonce, session.hex()), nonce, None, [], None]
        frames = entry[0].open(body)  # AuthError (a WireError) when forged, replayed or out of order
        if made:
            self._streams[session] = entry
        if sender:
            entry[4] = sender  # where its credits go: the connection its (authenticated) items come on
        self.received_bytes += frames_bytes(frames)
        self.received_items += 1
        if entry[2] is not None:
            entry[2](frames)
        elif len(entry[3]) < MAX_EARLY_ITEMS:
            entry[3].append(frames)
        else:
            raise WireError("a stream's consumer did not register in time; item dropped")

    def close(self) -> None:
        self._closed = True
