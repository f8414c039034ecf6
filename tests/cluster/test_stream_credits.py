"""Backpressure across the peer mailbox (issue 31, item 6): a producer far ahead of its consumer waits on a credit.

Two mailboxes on loopback, as two workers' are: the producer's end of a stream (`StreamSender`, as a
delegated loop holds it) pushes as fast as its credit lets it; the consumer's end (`InboundStream`)
is read one chunk at a time, slowly. The items sent and not yet taken never exceed
`PeerMailbox.STREAM_WINDOW` (plus the one chunk the policy holds), the consumer's queue of chunks
stays as short, and every item still arrives in order. A consumer that ends early releases its
producer for good (it must not wait on a stream nobody reads), and a stream whose chunks the
policy holds (a large chunk) never stalls its producer.
"""

import asyncio
import time

import pytest

from mstar_core.cluster.peer_mailbox import PeerMailbox
from mstar_core.cluster.peer_streams import InboundStream, StreamLines, StreamSender
from mstar_core.graph.walk import StreamingGraphEdge
from mstar_core.streaming.policies import FixedChunkPolicy

pytestmark = pytest.mark.timeout(60)

SECRET = b"c" * 24
WINDOW = PeerMailbox.STREAM_WINDOW


def ends(producer: PeerMailbox, consumer: PeerMailbox, chunk: int, session: str = "22" * 8):
    """(sender, inbound) of one stream from `producer` to `consumer`, the consumer registered."""
    edge = StreamingGraphEdge("gen.x", "use.x", FixedChunkPolicy(chunk))
    route = {"to": consumer.address, "nonce": "cd", "session": session, "start": 0}
    sender = StreamSender(edge, 0, "r", route, StreamLines(producer))
    inbound = InboundStream(edge, session, ack=lambda taken: consumer.ack_stream(session, taken))
    consumer.accept_stream(session, "cd", inbound.deliver)
    return sender, inbound


async def produce(sender: StreamSender, count: int) -> None:
    for i in range(count):
        await sender.credit()  # what a delegated loop awaits before each node call
        sender.push(i)
        if i % 8 == 0:
            await asyncio.sleep(0)  # let each batch of items go out


@pytest.fixture
async def mailboxes():
    producer, consumer = PeerMailbox(SECRET), PeerMailbox(SECRET)
    yield producer, consumer
    producer.close()
    consumer.close()


async def test_a_slow_consumer_holds_its_producer_to_the_window(mailboxes):
    producer, consumer = mailboxes
    sender, inbound = ends(producer, consumer, chunk=4)
    total = 20 * WINDOW
    task = asyncio.ensure_future(produce(sender, total))
    got, worst_ahead, worst_ready = [], 0, 0
    deadline = time.monotonic() + 40
    while len(got) < total:
        assert time.monotonic() < deadline, (len(got), sender.sent, consumer.stats())
        chunk = await asyncio.wait_for(inbound.stream.next_chunk(), 10)
        got += list(chunk.new_items)
        await asyncio.sleep(0.001)  # a slow consumer
        worst_ahead = max(worst_ahead, sender.sent - len(got))
        worst_ready = max(worst_ready, len(inbound.stream._ready))
    await asyncio.wait_for(task, 10)
    assert got == list(range(total))
    assert worst_ahead <= WINDOW + 4, worst_ahead  # the window, plus the chunk being formed
    assert worst_ready <= WINDOW // 4 + 1, worst_ready
    assert producer.stats()["streams_waiting_for_credit"] == 0
    assert consumer.stats()["stream_acks_sent"] >= total // PeerMailbox.ACK_EVERY - 1


async def test_a_producer_without_credits_is_stopped_at_the_window(mailboxes):
    producer, consumer = mailboxes
    sender, inbound = ends(producer, consumer, chunk=1)
    task = asyncio.ensure_future(produce(sender, 10 * WINDOW))
    await asyncio.sleep(1.0)  # nobody reads
    assert not task.done() and sender.sent == WINDOW, sender.sent
    assert producer.stats()["streams_waiting_for_credit"] == 1
    consumer.drop_stream(inbound.session)  # the consumer ended early: its producer runs on, never waits again
    await asyncio.wait_for(task, 10)
    assert sender.sent == 10 * WINDOW


async def test_items_the_policy_holds_count_as_taken(mailboxes):
    producer, consumer = mailboxes
    sender, inbound = ends(producer, consumer, chunk=4 * WINDOW)  # one chunk needs four windows of items
    await asyncio.wait_for(produce(sender, 4 * WINDOW), 10)
    chunk = await asyncio.wait_for(inbound.stream.next_chunk(), 10)
    assert list(chunk.new_items) == list(range(4 * WINDOW))
