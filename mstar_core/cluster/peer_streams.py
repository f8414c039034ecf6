"""Both worker ends of a stream whose producer and consumer run on two different workers.

The producer's worker sends every kept item straight to the consumer's worker over the peer line
(`peer_mailbox.PeerMailbox`), on one sealed session per stream however many of its loop runs feed it
(`StreamLines`); the consumer's worker runs the stream's chunk policy (the only place it runs)
and its consumer. The serving process only starts both sides and says how many items the
producing stage sent in all (`StreamEnd`), so the consumer knows when the stream is complete.

Backpressure: the consumer's end reports the items it has taken off the line back to the
producer's mailbox (`PeerMailbox.ack_stream`), and a run feeding the stream waits before its next
node call while `stream_outbox.STREAM_WINDOW` of its items are not taken (`StreamSender.credit`), so
a producer far ahead of its consumer holds at most that many items per stream in flight and queued.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mstar_core.cluster.remote_values import from_wire, to_wire
from mstar_core.cluster.stream_outbox import ACK_EVERY
from mstar_core.graph.walk import StreamingGraphEdge, StreamProgress
from mstar_core.runtime.streams import RequestStream
from mstar_core.streaming.policies import Chunk
from mstar_core.wire import WireError, decode, encode
from mstar_core.wire.messages import StreamItem


class StreamLines:
    """The producer worker's sending side of each stream session, shared by every run that feeds the stream.

    Several loop runs may feed one stream at once (the copies of a fan-out, loops in two Parallel
    branches calling the same node): they seal on one channel, so the consumer's worker sees one
    sequence in the order this worker made the items (no run's numbering collides with another's),
    and a priority sees the whole stream's progress, as in one process. Kept until the request's release.
    """

    __slots__ = ("_by_request", "mailbox")

    def __init__(self, mailbox: Any):
        self.mailbox = mailbox
        self._by_request: dict[str, dict[str, tuple[Any, RequestStream]]] = {}

    def line(self, request_id: str, edge: StreamingGraphEdge, route: dict[str, Any]) -> tuple[Any, RequestStream]:
        """(sealing channel, progress) of the stream `route` names; made on its first run here."""
        lines = self._by_request.setdefault(request_id, {})
        session = str(route["session"])
        entry = lines.get(session)
        if entry is None:  # `start`: items sent on it before this worker held it (0 while the request keeps it)
            channel = self.mailbox.stream_channel(str(route["nonce"]), session, int(route["start"]))
            entry = lines[session] = (channel, RequestStream(edge, accounting=True))
        return entry

    def release(self, request_id: str) -> None:
        for session in self._by_request.pop(request_id, {}):
            self.mailbox.forget_credit(session)

    def open_count(self) -> int:
        return sum(len(lines) for lines in self._by_request.values())


class StreamSender:
    """One run's end of a stream at the producer worker: counts progress (for priorities), sends each kept item."""

    __slots__ = ("accounting", "address", "channel", "edge", "index", "mailbox", "nonce", "request_id", "sent",
                 "session", "src_output")

    def __init__(self, edge: StreamingGraphEdge, index: int, request_id: str, route: dict[str, Any],
                 lines: StreamLines):
        self.edge = edge
        self.src_output = edge.src_output
        self.index = index
        self.request_id = request_id
        self.mailbox = lines.mailbox
        self.address, self.nonce, self.session = str(route["to"]), str(route["nonce"]), str(route["session"])
        self.channel, self.accounting = lines.line(request_id, edge, route)
        self.sent = 0  # items this run sent (the serving process adds up every run's for the stream's end)

    def push(self, value: Any) -> None:
        if self.edge.keep is not None and not self.edge.keep(value):
            return
        self.accounting.push_kept(value)
        frames = encode(StreamItem(request_id=self.request_id, stream=self.index, value=to_wire(value)))
        self.mailbox.send_stream(self.address, self.nonce, self.channel, frames)
        self.sent += 1

    async def credit(self) -> None:
        """Wait while the stream's consumer has not taken `stream_outbox.STREAM_WINDOW` of the items sent on it."""
        await self.mailbox.stream_credit(self.session, self.channel)

    def progress(self, now: float | None = None) -> StreamProgress:
        return self.accounting.progress(now)


async def wait_for_credits(senders: dict[int, StreamSender]) -> None:
    """A run's credit (`RequestState.credit`): every stream it feeds worker to worker has room for more items."""
    for sender in senders.values():
        await sender.credit()


class _TakenStream(RequestStream):
    """A stream that says when its consumer takes a chunk (so its end can report the items taken)."""

    __slots__ = ("on_taken",)

    def _pop(self) -> Chunk:
        chunk = super()._pop()
        self.on_taken()
        return chunk


class InboundStream:
    """The consumer worker's end: items from the peer line into the stream, closed once all `StreamEnd` counts came."""

    __slots__ = ("ack", "acked", "error", "expected", "received", "session", "stream")

    def __init__(self, edge: StreamingGraphEdge, session: str, ack: Callable[[int], None] | None = None):
        self.stream = _TakenStream(edge)
        self.stream.on_taken = self._report
        self.session = session
        self.received = 0
        self.expected: int | None = None
        self.error: Exception | None = None
        self.ack = ack  # reports how many items are off the line to the producer's mailbox (its credits)
        self.acked = 0

    def taken(self) -> int:
        """Items off the line: received, less those waiting in chunks the consumer has not taken (the policy's count)."""
        return self.received - sum(len(c.new_items) for c in self.stream._ready)

    def _report(self) -> None:
        # every ACK_EVERY items: a producer waits only once a whole window is untaken, so it always hears again
        if self.ack is None:
            return
        taken = self.taken()
        if taken - self.acked >= ACK_EVERY:
            self.acked = taken
            self.ack(taken)

    def deliver(self, frames: list[Any]) -> None:
        """One item's frames, in the order the producer sent them (called by the mailbox)."""
        if self.stream.closed:
            return
        try:
            msg = decode(frames)
            if not isinstance(msg, StreamItem):
                raise WireError(f"expected a stream item, got a {type(msg).__name__}")
            value = from_wire(msg.value)
        except Exception as exc:  # a bug on the other side: fail this request's consumer, not the line
            self.fail(exc)
            return
        self.stream.push_kept(value)
        self.received += 1
        self._report()
        self._close_when_complete()

    def end(self, items: int) -> None:
        """The producing stage ended after `items` items: close once they all arrived (the policy flushes its tail)."""
        self.expected = items
        self._close_when_complete()

    def fail(self, exc: Exception) -> None:
        self.error = exc
        self.stream.close()

    def _close_when_complete(self) -> None:
        if self.expected is not None and self.received >= self.expected:
            self.stream.close()
