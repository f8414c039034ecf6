"""The per-walk KV move goes straight from the prefill worker to the decode worker (issue 17).

The serving process sends each worker one control message for the move; the KV pages travel on a
direct worker-to-worker line sealed with keys derived from the shared secret and the move's nonce.
"""

import asyncio
import time
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from mstar_core.cluster.peer_mailbox import PeerMailbox
from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import load_placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.wire import Release, encode
from tests.cluster.helpers import kv_pages_used

pytestmark = pytest.mark.timeout(180)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "placement" / "llama-prefill-decode.yaml"
PROMPTS = [[(7 * i + j) % 300 + 3 for j in range(160)] for i in range(3)]


async def until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def moved(state) -> int:
    link = state.link.stats
    return link.sent_bytes + link.received_bytes


async def test_the_kv_moves_between_workers_directly_and_only_control_messages_pass_the_server():
    engine = placed_engine(discover())
    colocated = placed_engine(discover())
    await engine.load_model("llama", LoadOptions(preset="tiny"), placement=load_placement(EXAMPLE))
    await colocated.load_model("llama", LoadOptions(preset="tiny"))
    try:
        prefill, decode = engine.cluster.workers["prefill"], engine.cluster.workers["decode"]
        deadline = time.monotonic() + 20
        while "peer" not in decode.load or "peer" not in prefill.load:  # mailboxes reported in heartbeats
            assert time.monotonic() < deadline, decode.load
            await asyncio.sleep(0.05)
        # heartbeats pass the server the whole time (~10 KB/s here): their rate, measured idle, is allowed for on
        # top of a request's own bytes, so a slow box does not read as KV through the server (a move is > 50 KB)
        idle_from, idle_start = moved(prefill) + moved(decode), time.monotonic()
        await asyncio.sleep(1.0)
        idle_rate = (moved(prefill) + moved(decode) - idle_from) / (time.monotonic() - idle_start)
        for prompt in PROMPTS:
            request = {"input_ids": prompt, "max_tokens": 1, "ignore_eos": True}
            want = (await colocated.generate("llama", dict(request)))["next_token"]
            before, started = (moved(prefill), moved(decode)), time.monotonic()
            # max_tokens 1 ends after the prefill: add a decode step so the request moves
            request["max_tokens"] = 3
            got = [o.value async for o in engine.submit("llama", request) if o.name == "next_token"]
            assert got[0] == want and len(got) == 3
            through_server = moved(prefill) - before[0] + moved(decode) - before[1]
            allowed = 16_000 + idle_rate * (time.monotonic() - started)  # prompt, tokens, control messages
            assert through_server < allowed, (through_server, allowed)
        deadline = time.monotonic() + 10
        while min(decode.load["peer"]["received_moves"], prefill.load["peer"]["sent_moves"]) < len(PROMPTS):
            assert time.monotonic() < deadline, decode.load["peer"]
            await asyncio.sleep(0.05)
        peer_bytes = prefill.load["peer"]["sent_bytes"]
        assert prefill.load["peer"]["sent_moves"] == len(PROMPTS)
        assert decode.load["peer"]["received_bytes"] == peer_bytes
        assert peer_bytes > 10 * 16_000  # the KV pages went worker to worker
        for name in ("prefill", "decode"):
            assert await kv_pages_used(engine, name, "llama/lm") == 0, name
    finally:
        await engine.close()
        await colocated.close()


async def test_a_mailbox_opens_only_moves_sealed_with_the_secret_and_each_once():
    secret = b"s" * 24
    box = PeerMailbox(secret)
    other = PeerMailbox(secret)
    forger = PeerMailbox(b"x" * 24)
    try:
        frames = encode(Release(request_id="r"))
        await forger.send(box.address, "n1", "00" * 8, frames)  # wrong secret: dropped
        await other.send(box.address, "n2", "11" * 8, frames)
        got = await asyncio.wait_for(box.expect("11" * 8), 5)
        assert bytes(got[0]) == bytes(frames[0])
        await until(lambda: box.refused == 1)  # each sender has its own connection: no order between them
        assert box.received_moves == 1
        # the same move again (a replay) is refused; the waiting import never sees it
        await other.send(box.address, "n2", "11" * 8, frames)
        raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        raw.connect(box.address)
        await raw.send_multipart([b"junk"])  # malformed: dropped, the mailbox goes on
        await other.send(box.address, "n3", "22" * 8, frames)
        await asyncio.wait_for(box.expect("22" * 8), 5)
        await until(lambda: box.refused == 3)
        assert box.received_moves == 2
        raw.close(0)
    finally:
        for b in (box, other, forger):
            b.close()
