"""The peer line sends the stream items of one event-loop turn as one message; each item is still checked alone."""

import asyncio
import time

from mstar_core.cluster.peer_mailbox import PeerMailbox
from mstar_core.wire import decode, encode
from mstar_core.wire.batch import join_messages
from mstar_core.wire.messages import StreamItem

SECRET = b"k" * 24


async def _until(check, mailbox, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, mailbox.stats()
        await asyncio.sleep(0.01)


async def test_items_of_one_turn_for_many_streams_go_as_one_message_and_arrive_in_order_per_stream():
    remote, local = PeerMailbox(SECRET), PeerMailbox(SECRET)
    try:
        got = {s: [] for s in ("aa", "bb", "cc")}
        sessions = {s: f"{i + 1:02d}" * 8 for i, s in enumerate(got)}
        channels = {s: local.stream_channel(s, sessions[s], start=0) for s in got}
        for s in got:
            remote.accept_stream(sessions[s], s, got[s].append)
        for step in range(4):  # a decode step: one token per stream, all in one turn
            for s in got:
                local.send_stream(remote.address, s, channels[s], encode(StreamItem(request_id=s, stream=0, value=step)))
            await asyncio.sleep(0)  # the turn ends: the step's items go out
        await _until(lambda: remote.streams_in.received_items == 12, remote)
        assert {s: [decode(f).value for f in items] for s, items in got.items()} == {s: [0, 1, 2, 3] for s in got}
        assert local.streams_out.sent_items == 12 and local.streams_out.messages_sent == 4
        assert remote.refused == 0
    finally:
        remote.close()
        local.close()


async def test_a_replayed_item_inside_a_batch_is_refused_alone_and_the_rest_are_delivered():
    remote, local = PeerMailbox(SECRET), PeerMailbox(SECRET)
    try:
        got = []
        session = "ab" * 8
        channel = local.stream_channel("n1", session, start=0)
        remote.accept_stream(session, "n1", got.append)
        sealed = [channel.seal(encode(StreamItem(request_id="r", stream=0, value=i))) for i in range(3)]
        messages = [[b"sn1", *sealed[0]], [b"sn1", *sealed[0]], [b"sn1", *sealed[1]], [b"sn1", *sealed[2]]]
        sock = local._socket(remote.address)
        await sock.send_multipart(join_messages(messages), copy=False)  # the second is a replay of the first
        await _until(lambda: remote.refused == 1 and len(got) == 3, remote)
        assert [decode(f).value for f in got] == [0, 1, 2]
        await sock.send_multipart(join_messages([[b"sn1", b"x"], [b"sn1"]])[:3], copy=False)  # counts do not fit
        await _until(lambda: remote.refused == 2, remote)
        assert len(got) == 3
    finally:
        remote.close()
        local.close()


async def test_a_decode_step_of_many_requests_reaches_the_server_and_the_codec_in_one_message_each():
    """Disaggregated Orpheus at concurrency 4: the LM worker's loop values and stream items go out once a step."""
    import pytest

    pytest.importorskip("mstar_orpheus")
    from tests.cluster.helpers import peer_figure, traffic
    from tests.cluster.test_direct_streams import disaggregated, since

    engine = await disaggregated()
    try:
        lm = engine.cluster.workers["lm"]
        before, sockets_before = traffic(engine, "lm"), lm.socket_messages_received

        async def one(seed):
            request = {"text": "Hello from M star.", "voice": "tara", "seed": seed, "max_tokens": 120}
            return [o async for o in engine.submit("orpheus", request) if o.name == "next_token"]

        tokens = await asyncio.gather(*(one(seed) for seed in range(4)))
        after, sockets = traffic(engine, "lm"), lm.socket_messages_received - sockets_before
        loop_values = since(after, before, "received", "loop_values")[0]
        assert loop_values == sum(map(len, tokens)) > 300  # one per token, as before
        # the four requests step together: about one socket message a step (plus heartbeats and the loop ends)
        assert sockets < loop_values / 2, (sockets, loop_values)
        items = await peer_figure(engine, "lm", "stream_sent_items", 300)
        messages = (engine.cluster.workers["lm"].load.get("peer") or {})["stream_messages_sent"]
        assert messages < items / 2, (messages, items)
    finally:
        await engine.close()
