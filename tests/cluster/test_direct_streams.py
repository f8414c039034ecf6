"""A stream between two workers goes peer to peer (issue 17): disaggregated Orpheus, LM on one, SNAC on another.

The LM worker's decode loop sends each audio token straight to the codec worker, whose copy of the
stream runs the sliding-window policy and the SNAC calls; the serving process only starts both sides
and tells the codec how many items the stream had. Counted: what passes through the serving process.
"""

import asyncio
import time
from pathlib import Path

import pytest
import torch

from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import load_placement
from mstar_core.errors import RequestCancelled
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from tests.cluster.helpers import kill_mid_request, kv_pages_used, peer_figure, traffic, until

pytest.importorskip("mstar_orpheus")
pytestmark = pytest.mark.timeout(240)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "placement"
REQUEST = {"text": "Hello from M star.", "voice": "tara", "seed": 7, "max_tokens": 160}
LONG = {"text": "Hello from M star, " * 8, "voice": "tara", "seed": 7, "max_tokens": 4000}


async def audio_of(engine, request=REQUEST):
    outs = [o async for o in engine.submit("orpheus", dict(request))]
    return [torch.as_tensor(o.value).clone() for o in outs if o.name == "audio"], \
        [o.value for o in outs if o.name == "next_token"]


def since(after, before, direction, tag):
    a, b = after[direction].get(tag, [0, 0]), before[direction].get(tag, [0, 0])
    return a[0] - b[0], a[1] - b[1]


async def disaggregated():
    engine = placed_engine(discover())
    await engine.load_model("orpheus", LoadOptions(preset="tiny"), placement=load_placement(
        EXAMPLES / "orpheus-disaggregated.yaml"))
    deadline = time.monotonic() + 20
    while any("peer" not in w.load for w in engine.cluster.workers.values()):  # mailboxes in heartbeats
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    return engine


async def test_the_stream_goes_worker_to_worker_and_only_control_messages_pass_the_server():
    colocated = placed_engine(discover())
    await colocated.load_model("orpheus", LoadOptions(preset="tiny"))
    try:
        want, want_tokens = await audio_of(colocated)
    finally:
        await colocated.close()
    engine = await disaggregated()
    try:
        conductor = engine._models["orpheus"].conductor
        assert set(conductor.direct_streams) == {"decode"}
        before = traffic(engine, "codec")
        got, tokens = await audio_of(engine)
        after = traffic(engine, "codec")
        assert tokens == want_tokens and len(got) == len(want) > 2
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        # to the codec worker: one RunConsumer, one StreamEnd, one Release; no node call carrying a window
        assert since(after, before, "sent", "invoke_node") == (0, 0)
        sent = {tag: since(after, before, "sent", tag)[0] for tag in after["sent"]}
        assert {t: n for t, n in sent.items() if n} == {"run_consumer": 1, "stream_end": 1, "release": 1}
        to_codec = sum(since(after, before, "sent", tag)[1] for tag in after["sent"])
        assert to_codec < 2_000, to_codec  # the request's few env values and ids, never the 28-token windows
        # back: the audio itself (the walk emits it) and the end of the consumer
        assert since(after, before, "received", "loop_values")[0] == len(got)
        keep = conductor.graph.walks["decode"].streams[0].keep  # which tokens are audio codes
        audio_tokens = sum(1 for t in tokens if keep(t))
        assert await peer_figure(engine, "codec", "stream_received_items", audio_tokens) == audio_tokens
        assert await peer_figure(engine, "lm", "stream_sent_items", audio_tokens) == audio_tokens

        # the same request with the stream kept in the serving process (the fallback path) gives the same audio,
        # and then every window passes through it as a node call's input
        plans, conductor.direct_streams = conductor.direct_streams, {}
        before = traffic(engine, "codec")
        fallback, _ = await audio_of(engine)
        after = traffic(engine, "codec")
        conductor.direct_streams = plans
        assert all(torch.equal(a, b) for a, b in zip(fallback, want, strict=True)) and len(fallback) == len(want)
        assert since(after, before, "sent", "invoke_node")[0] == len(want)
        assert since(after, before, "sent", "invoke_node")[1] > len(want) * 28 * 6  # windows of 28 ids as JSON
    finally:
        await engine.close()


async def test_a_request_cancelled_mid_stream_frees_both_workers():
    engine = await disaggregated()
    codec = engine.cluster.workers["codec"]
    try:
        for _ in range(2):
            handle = engine.submit("orpheus", dict(LONG))
            async for out in handle:
                if out.name == "audio":
                    break
            handle.cancel()
            with pytest.raises(RequestCancelled):
                await asyncio.wait_for(handle.result(), 10)
            assert await kv_pages_used(engine, "lm", "orpheus/lm") == 0
            await until(lambda: codec.load.get("peer", {}).get("streams_open") == 0, 5,
                        "the codec to drop its end of the stream")
        got, _ = await audio_of(engine)  # both workers serve the next request as before
        assert got
    finally:
        await engine.close()


async def test_a_killed_producer_worker_fails_its_request_and_the_codec_drops_its_stream():
    engine = await disaggregated()
    lm = engine.cluster.workers["lm"]
    try:
        await kill_mid_request(engine, "orpheus", LONG, "lm", "audio")
        codec = engine.cluster.workers["codec"]
        await until(lambda: codec.load.get("peer", {}).get("streams_open") == 0, 5, "the codec to drop its stream")
        await until(lambda: lm.ready, 90, "the LM worker to come back")
        # the new process's mailbox has a new address
        await until(lambda: "peer" in lm.load, 10, "the restarted LM worker's mailbox")
        got, _ = await audio_of(engine)
        assert got  # served again, peer to peer, by the restarted LM worker
    finally:
        await engine.close()


def _outward_address() -> str | None:
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 9))  # no packet: picks the interface a route leaves by
            host = s.getsockname()[0]
    except OSError:
        return None
    return None if host.startswith("127.") else host


async def test_stream_items_reach_a_mailbox_open_to_other_hosts_from_one_on_loopback_sealed_and_in_order():
    from mstar_core.cluster.peer_mailbox import PeerMailbox
    from mstar_core.wire import encode
    from mstar_core.wire.messages import StreamItem

    host = _outward_address()
    if host is None:
        pytest.skip("no non-loopback interface to bind a mailbox on")
    secret = b"s" * 24
    remote = PeerMailbox(secret, host, encrypt=True)  # a worker joined from another host: CURVE
    local = PeerMailbox(secret)  # a worker joined over loopback: sends to it with CURVE all the same
    try:
        got = []
        channel = local.stream_channel("ab", "11" * 8, start=0)
        for i in range(3):  # two items arrive before the consumer registers, kept in order
            local.send_stream(remote.address, "ab", channel, encode(StreamItem(request_id="r", stream=0, value=i)))
        deadline = time.monotonic() + 5
        while remote.streams_in.received_items < 3:
            assert time.monotonic() < deadline, remote.stats()
            await asyncio.sleep(0.02)
        remote.accept_stream("11" * 8, "ab", got.append)
        local.send_stream(remote.address, "ab", channel, encode(StreamItem(request_id="r", stream=0, value=3)))
        while len(got) < 4:
            assert time.monotonic() < deadline, remote.stats()
            await asyncio.sleep(0.02)
        from mstar_core.wire import decode

        assert [decode(f).value for f in got] == [0, 1, 2, 3]
        remote.drop_stream("11" * 8)  # later items of an ended stream are dropped quietly
        local.send_stream(remote.address, "ab", channel, encode(StreamItem(request_id="r", stream=0, value=4)))
        while remote.streams_in.late_items < 1:
            assert time.monotonic() < deadline, remote.stats()
            await asyncio.sleep(0.02)
        assert remote.refused == 0 and len(got) == 4
    finally:
        remote.close()
        local.close()
