"""No bytes from a peer stop the worker control plane (finding 3 of issue 10).

A serving process with one spawned worker runs on its own event loop in a thread; unauthenticated
peers throw random and mutated messages at its real control socket (hypothesis), and afterwards a
request through the worker still succeeds and the worker was never declared lost.
"""

from __future__ import annotations

import asyncio
import threading
import time

import attrs
import orjson
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mstar_transport_shm.link import CONTROL, DATA

from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import Placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.wire import Heartbeat, NodeResult, encode
from mstar_core.wire.auth import make_hello
from mstar_core.wire.session import MAGIC, Channel

pytestmark = pytest.mark.timeout(180)


class ServerThread:
    """An AsyncEngine serving fixture-stream with `gen` in a worker, on an event loop in a thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine = self.call(self._start(), 120)

    async def _start(self):
        placement = Placement.from_dict({"workers": {"gen": {}}, "nodes": {"gen": "gen"},
                                         "control": {"heartbeat_interval": 0.2}})
        engine = placed_engine(discover())
        await engine.load_model("fixture-stream", LoadOptions(preset="tiny"), placement=placement)
        return engine

    def call(self, coro, timeout=30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def tokens(self, start, stop):
        async def run():
            return (await self.engine.submit("fixture-stream", {"start": start, "stop": stop}).result())["token"]
        return self.call(run())

    def close(self):
        self.call(self.engine.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def server():
    srv = ServerThread()
    yield srv
    srv.close()


class Peer:
    """A raw DEALER on the control socket; `identity` spoofs a routing id."""

    def __init__(self, ctx, address, identity=None):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if identity:
            self.sock.setsockopt(zmq.ROUTING_ID, identity)
        self.sock.connect(address)

    def send(self, frames):
        self.sock.send_multipart(frames)

    def received(self) -> bool:
        return bool(self.sock.poll(0))

    def close(self):
        self.sock.close(0)


def _hello_with(**fields):
    hello = make_hello(b"not the secret at all!", "gen")
    hello_fields = {s.name: getattr(hello, s.name) for s in type(hello).__wire_fields__}
    hello_fields.update(fields)
    return orjson.dumps({"type": "hello", "fields": hello_fields, "tensors": []}, default=str)


junk_text = st.text(max_size=24) | st.sampled_from(["é" * 64, "ü" * 63 + "0", "\u0000" * 64, "0" * 64, "gen"])
junk_value = (junk_text | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.none()
              | st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3)
              | st.dictionaries(st.text(max_size=4), st.integers(-(2**63), 2**63 - 1), max_size=2))
hello_field = st.sampled_from(["worker", "pid", "host", "protocol", "nonce", "timestamp", "mac"])


@st.composite
def attacks(draw, session: bytes, worker_identity: bytes):
    """(identity, frames) of one unauthenticated message."""
    kind = draw(st.sampled_from(["random", "hello", "hello-junk", "sealed", "shm", "plain", "json"]))
    if kind == "random":
        frames = draw(st.lists(st.binary(max_size=64), min_size=1, max_size=4))
    elif kind == "hello":  # a well-formed Hello, signed with the wrong secret, with one field swapped for junk
        frames = [_hello_with(**{draw(hello_field): draw(junk_text)})]
    elif kind == "hello-junk":
        frames = [_hello_with(**draw(st.dictionaries(hello_field, junk_value, max_size=4)))]
    elif kind == "sealed":  # looks sealed for the live session (or another one), with a forged tag
        sid = session if draw(st.booleans()) else draw(st.binary(min_size=8, max_size=8))
        seq = draw(st.integers(0, 2**64 - 1)).to_bytes(8, "big")
        frames = [MAGIC + sid + seq + draw(st.binary(min_size=16, max_size=16)),
                  *draw(st.lists(st.binary(max_size=32), max_size=3))]
    elif kind == "shm":
        frames = [draw(st.sampled_from([DATA, CONTROL])), draw(st.binary(max_size=48) | st.just(b'{"d":[[1,2,3]],"r":[]}'))]
    elif kind == "plain":  # what a worker would send, but unsealed
        frames = encode(draw(st.sampled_from([
            Heartbeat(worker="gen", seq=10**6, time=time.time(), load={"fixture-stream/gen": {"active": 1e9}}),
            NodeResult(request_id="r", node="fixture-stream/gen", call_index=0, error="x", error_type="E"),
        ])))
    else:
        frames = [orjson.dumps(draw(st.dictionaries(st.sampled_from(["type", "fields", "tensors"]), junk_value)))]
    identity = draw(st.sampled_from([None, worker_identity, b"\x00" + worker_identity[1:], b"gen"]))
    return identity, frames


def test_random_and_mutated_messages_from_unauthenticated_peers_do_not_stop_serving(server):
    cluster = server.engine.cluster
    gen = cluster.workers["gen"]
    pid, session, identity = gen.process.pid, gen.channel.session, gen.identity
    assert server.tokens(0, 5) == 5
    ctx = zmq.Context()
    peers: dict[bytes | None, Peer] = {}
    refused_before = cluster.refusals.count

    # a Hello the coordinator has already seen (as if captured on the wire and replayed)
    seen = make_hello(cluster.secret, "gen")
    server.loop.call_soon_threadsafe(cluster.handshake.verifier.verify, seen)
    # a real message of the live session, replayed (its sequence number was accepted long ago)
    worker_end = Channel(session, gen.channel._recv_key, gen.channel._send_key)
    replayed = worker_end.seal(encode(Heartbeat(worker="gen", seq=1, time=time.time())))

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
    @given(attacks(session, identity))
    def attack(case):
        who, frames = case
        if who not in peers:
            peers[who] = Peer(ctx, cluster.address, who)
        peers[who].send(frames)

    try:
        attack()
        peer = Peer(ctx, cluster.address)
        for _ in range(3):
            peer.send(encode(seen))
            peer.send(replayed)
            peer.send(encode(attrs.evolve(make_hello(b"not the secret at all!", "gen"), mac="é" * 64)))
        time.sleep(1.0)
        # the control plane still serves: a request through the worker, and the worker never counted as lost
        assert server.tokens(3, 9) == 9
        assert gen.alive and gen.ready and gen.restarts == 0 and gen.process.pid == pid
        assert gen.channel.session == session
        assert cluster.refusals.count - refused_before > 100  # they were seen and refused, not lost
        assert cluster.receiver.task is not None and not cluster.receiver.task.done()
        assert not any(p.received() for p in [*peers.values(), peer])  # nobody unauthenticated got an answer
    finally:
        ctx.destroy(linger=0)


def test_a_worker_still_joins_after_the_junk(server):
    """A restarted worker authenticates and serves after all of the above (the Hello path is intact)."""
    cluster = server.engine.cluster
    gen = cluster.workers["gen"]
    old_pid = gen.process.pid
    server.loop.call_soon_threadsafe(cluster.kill, "gen")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (gen.ready and gen.process.pid != old_pid):
        time.sleep(0.1)
    assert gen.ready and gen.process.pid != old_pid
    assert server.tokens(1, 4) == 4
