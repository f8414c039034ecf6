"""/metrics shows each worker's peer line: stream items and bytes sent worker to worker, late items, refusals.

The end-to-end test runs the disaggregated Orpheus (LM on one worker, SNAC on another, the audio-token
stream going straight from one to the other) and reads the exposition /metrics serves before and after
each request: the LM worker sent, and the codec worker received, one item per audio token, while only
three control messages went from the serving process to the codec worker.
"""

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mstar_core.api.server.metrics import Metrics
from mstar_core.cluster.strategy import placed_engine
from mstar_core.cluster.worker_link import WorkerLink
from mstar_core.config import load_placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from tests.cluster.helpers import until

pytestmark = pytest.mark.timeout(180)

PLACEMENT = Path(__file__).resolve().parents[2] / "examples" / "placement" / "orpheus-disaggregated.yaml"
PEER = {"address": "tcp://127.0.0.1:5555", "sent_bytes": 10, "received_bytes": 20, "sent_moves": 1,
        "received_moves": 2, "refused": 3, "stream_sent_bytes": 400, "stream_received_bytes": 0,
        "stream_sent_items": 40, "stream_received_items": 0, "stream_late_items": 5, "streams_open": 1,
        "stream_messages_sent": 7}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, keyed by (name, sorted labels)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def peer(scrape, name: str, worker: str, direction: str | None = None) -> float:
    labels = {"worker": worker, **({"direction": direction} if direction else {})}
    return scrape.get((name, tuple(sorted(labels.items()))), 0.0)


def rise(now, before, name: str, worker: str, direction: str | None = None) -> float:
    return peer(now, name, worker, direction) - peer(before, name, worker, direction)


def messages(scrape, worker: str, direction: str) -> dict[str, float]:
    """Messages through the serving process to or from `worker`, by kind."""
    out = {}
    for (name, labels), value in scrape.items():
        labels = dict(labels)
        if name == "mstar_link_messages_total" and labels["worker"] == worker and labels["direction"] == direction:
            out[labels["message"]] = value
    return out


def test_peer_counters_come_from_each_workers_heartbeat():
    worker = WorkerLink("lm", SimpleNamespace(transport="zmq"))
    worker.load = {"peer": PEER}
    worker.traffic["sent"]["run_consumer"] = [2, 300]
    worker.socket_messages_received = 11
    gone = WorkerLink("codec", SimpleNamespace(transport="zmq"))  # lost: no heartbeat, so no samples (not zeros)
    cluster = SimpleNamespace(link_stats=lambda: {"lm": worker.link_stats(), "codec": gone.link_stats()})
    scrape = samples(Metrics(SimpleNamespace(cluster=cluster, models={})).render().decode())
    assert peer(scrape, "mstar_peer_stream_items_total", "lm", "sent") == 40
    assert peer(scrape, "mstar_peer_stream_items_total", "lm", "received") == 0
    assert peer(scrape, "mstar_peer_stream_bytes_total", "lm", "sent") == 400
    assert peer(scrape, "mstar_peer_stream_messages_total", "lm", "sent") == 7
    assert peer(scrape, "mstar_peer_moves_total", "lm", "received") == 2
    assert peer(scrape, "mstar_peer_move_bytes_total", "lm", "sent") == 10
    assert peer(scrape, "mstar_peer_stream_late_items_total", "lm") == 5
    assert peer(scrape, "mstar_peer_refused_total", "lm") == 3
    assert peer(scrape, "mstar_peer_streams_open", "lm") == 1
    labels = (("direction", "sent"), ("message", "run_consumer"), ("worker", "lm"))
    assert scrape["mstar_link_messages_total", labels] == 2 and scrape["mstar_link_message_bytes_total", labels] == 300
    assert scrape["mstar_link_socket_messages_total", (("worker", "lm"),)] == 11
    assert not [key for key in scrape if dict(key[1]).get("worker") == "codec" and key[0].startswith("mstar_peer")]
    assert not [key for key in scrape if "address" in dict(key[1])]  # a worker's port is not a label


async def settled(scrape, before, items: int, timeout: float = 10.0):
    """The scrape once the heartbeats after a request carry both ends' counts (`items` more sent and received)."""
    deadline = time.monotonic() + timeout
    while True:
        now = scrape()
        if rise(now, before, "mstar_peer_stream_items_total", "lm", "sent") == items and \
                rise(now, before, "mstar_peer_stream_items_total", "codec", "received") == items and \
                peer(now, "mstar_peer_streams_open", "codec") == 0:
            return now
        assert time.monotonic() < deadline, ({k: v for k, v in now.items() if k[0].startswith("mstar_peer")}, items)
        await asyncio.sleep(0.05)


async def test_disaggregated_orpheus_stream_counters_rise_with_each_request():
    pytest.importorskip("mstar_orpheus")
    engine = placed_engine(discover())
    await engine.load_model("orpheus", LoadOptions(preset="tiny"), placement=load_placement(PLACEMENT))
    metrics = Metrics(engine)  # what GET /metrics renders

    def scrape():
        return samples(metrics.render().decode())

    try:
        await until(lambda: all(("mstar_peer_streams_open", (("worker", w),)) in scrape() for w in ("lm", "codec")),
                    20, "both workers' peer lines on /metrics")
        keep = engine.models["orpheus"].graph.walks["decode"].streams[0].keep  # which tokens are audio codes
        now = scrape()
        for seed in (3, 4):
            before = now
            outs = [o async for o in engine.submit("orpheus", {"text": "Hello from M star.", "voice": "tara",
                                                              "seed": seed, "max_tokens": 160})]
            audio_tokens = sum(1 for o in outs if o.name == "next_token" and keep(o.value))
            assert audio_tokens > 0 and any(o.name == "audio" for o in outs)

            now = await settled(scrape, before, audio_tokens)
            sent_bytes = rise(now, before, "mstar_peer_stream_bytes_total", "lm", "sent")
            assert sent_bytes >= audio_tokens
            assert sent_bytes == rise(now, before, "mstar_peer_stream_bytes_total", "codec", "received")
            assert 0 < rise(now, before, "mstar_peer_stream_messages_total", "lm", "sent") <= audio_tokens
            # nothing went the other way, nothing came late or was refused, and no state moved
            assert rise(now, before, "mstar_peer_stream_items_total", "lm", "received") == 0
            assert rise(now, before, "mstar_peer_stream_items_total", "codec", "sent") == 0
            for worker in ("lm", "codec"):
                assert rise(now, before, "mstar_peer_stream_late_items_total", worker) == 0
                assert rise(now, before, "mstar_peer_refused_total", worker) == 0
                assert rise(now, before, "mstar_peer_moves_total", worker, "sent") == 0
            # and through the serving process to the codec: the consumer's start, the stream's end, the release
            sent, earlier = messages(now, "codec", "sent"), messages(before, "codec", "sent")
            rose = {kind: n - earlier.get(kind, 0) for kind, n in sent.items() if n > earlier.get(kind, 0)}
            assert rose == {"run_consumer": 1, "stream_end": 1, "release": 1}
    finally:
        await engine.close()
