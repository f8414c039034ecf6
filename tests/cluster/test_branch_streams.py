"""Streams produced by loops inside Parallel branches go peer to peer (issue 17's last case).

The fixture's `cfg` walk runs a `cond` and an `uncond` loop side by side on worker `a`, each streaming
through its own edge into `decode` calls on worker `b`; its `fan` walk runs `n` fan-out copies of one
loop on `a`, all feeding one stream into `decode` on `b`. Counted: what passes through the serving
process (only control messages), what each worker's peer line carried, and the outputs (the colocated ones).
"""

import asyncio
import time

import pytest
import torch
from mstar_fixture_plugin.branches import FAN_BRANCH, branch_of, item_of

from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import Placement
from mstar_core.errors import RequestCancelled
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from tests.cluster.helpers import peer_figure, traffic

pytestmark = pytest.mark.timeout(180)

MODEL = "fixture-branches"
CFG = {"walk": "cfg", "seed": 3, "length": 12}
FAN = {"walk": "fan", "seed": 5, "length": 9, "n": 3}


def placement(delay: float = 0.0) -> Placement:
    settings = {n: {"step_delay": delay} for n in ("cond", "uncond", "gen")} if delay else {}
    return Placement.from_dict({"workers": {"a": {}, "b": {}},
                                "nodes": {"cond": "a", "uncond": "a", "gen": "a", "decode": "b"},
                                "engine_settings": settings})


async def run(engine, request):
    """{output name: [values in order]} of one request."""
    handle = engine.submit(MODEL, dict(request))
    outs: dict[str, list] = {}
    async for out in handle:
        outs.setdefault(out.name, []).append(out.value)
    await handle.result()
    return outs


def sent_since(after, before, worker="b"):
    """{tag: (count, bytes)} the serving process sent `worker` between two `traffic` snapshots (tags that moved)."""
    was = before["sent"]
    moved = {t: (n - was.get(t, [0, 0])[0], b - was.get(t, [0, 0])[1]) for t, (n, b) in after["sent"].items()}
    return {t: v for t, v in moved.items() if v[0]}


async def split_engine(delay: float = 0.0):
    engine = placed_engine(discover())
    await engine.load_model(MODEL, LoadOptions(preset="tiny"), placement=placement(delay))
    deadline = time.monotonic() + 20
    while any("peer" not in w.load for w in engine.cluster.workers.values()):  # mailboxes known from heartbeats
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    return engine


def cfg_wav(outs, node):
    return torch.cat(outs[f"wav_{node}"])


def assert_cfg(outs, colocated):
    for node, branch in (("cond", 0), ("uncond", 1)):
        mine, theirs = outs[f"wav_{node}"], colocated[f"wav_{node}"]
        assert len(mine) == len(theirs) > 3 and all(torch.equal(x, y) for x, y in zip(mine, theirs, strict=True))
        want = torch.tensor([2.0 * item_of(CFG["seed"], branch, i) for i in range(CFG["length"])])
        assert torch.equal(cfg_wav(outs, node), want)


def assert_fan(outs, colocated):
    """Every copy's items, each once and in its order; chunks mix copies in whatever order they were made."""
    got, want = torch.cat(outs["wav"]) / 2, torch.cat(colocated["wav"]) / 2
    assert sorted(got.tolist()) == sorted(want.tolist()) == sorted(
        item_of(FAN["seed"], FAN_BRANCH + b, i) for b in range(FAN["n"]) for i in range(FAN["length"]))
    for b in range(FAN["n"]):
        mine = [x for x in got.tolist() if branch_of(x) == FAN_BRANCH + b]
        assert mine == [item_of(FAN["seed"], FAN_BRANCH + b, i) for i in range(FAN["length"])]


async def colocated():
    engine = placed_engine(discover())
    await engine.load_model(MODEL, LoadOptions(preset="tiny"))
    try:
        return await run(engine, CFG), await run(engine, FAN)
    finally:
        await engine.close()


async def test_each_branch_streams_worker_to_worker_and_a_cancelled_request_frees_every_stream():
    want = await colocated()
    engine = await split_engine(delay=0.005)  # slow enough to cancel a long request mid-stream
    try:
        await check_peer_to_peer(engine, *want)
        await check_cancelled_mid_stream(engine)
        outs = await run(engine, CFG)  # both workers serve the next request as before
        assert_cfg(outs, want[0])
    finally:
        await engine.close()


async def check_peer_to_peer(engine, want_cfg, want_fan):
    conductor = engine._models[MODEL].conductor
    assert {w: sorted(p) for w, p in conductor.direct_streams.items()} == {"cfg": [0, 1], "fan": [0]}
    items = 2 * CFG["length"]
    before = traffic(engine, "b")
    outs = await run(engine, CFG)
    after = traffic(engine, "b")
    assert_cfg(outs, want_cfg)
    # to the decoder's worker: a consumer start and a stream end per branch's stream, one release
    sent = sent_since(after, before)
    assert {t: n for t, (n, _) in sent.items()} == {"run_consumer": 2, "stream_end": 2, "release": 1}
    assert sum(b for _, b in sent.values()) < 2_000, sent  # ids and a few env values, never an item
    assert await peer_figure(engine, "b", "stream_received_items", items) == items
    assert await peer_figure(engine, "a", "stream_sent_items", items) == items
    await peer_state(engine, "a", "stream_lines", 0)  # released with the request

    # all fan-out copies feed one stream: each copy's run sends on it, in one sequence, from worker a
    before = traffic(engine, "b")
    outs = await run(engine, FAN)
    after = traffic(engine, "b")
    assert_fan(outs, want_fan)
    sent = sent_since(after, before)
    assert {t: n for t, (n, _) in sent.items()} == {"run_consumer": 1, "stream_end": 1, "release": 1}
    fan_items = FAN["n"] * FAN["length"]
    assert await peer_figure(engine, "b", "stream_received_items", items + fan_items) == items + fan_items

    # the same requests with the streams kept in the serving process (as before): every chunk passes through it
    plans, conductor.direct_streams = conductor.direct_streams, {}
    try:
        before = traffic(engine, "b")
        outs = await run(engine, CFG)
        fan = await run(engine, FAN)
        after = traffic(engine, "b")
    finally:
        conductor.direct_streams = plans
    assert_cfg(outs, want_cfg)
    assert_fan(fan, want_fan)
    calls = len(outs["wav_cond"]) + len(outs["wav_uncond"]) + len(fan["wav"])
    assert sent_since(after, before)["invoke_node"][0] == calls


async def check_cancelled_mid_stream(engine):
    """Cancelled mid-stream, a request leaves no stream open on either worker."""
    for request, streams in (({**CFG, "length": 400}, 2), ({**FAN, "length": 400}, 1)):
        handle = engine.submit(MODEL, dict(request))
        async for out in handle:
            if out.name.startswith("wav"):
                break
        await peer_state(engine, "b", "streams_open", streams)  # every stream of the walk is open on b, sending on a
        await peer_state(engine, "a", "stream_lines", streams)
        handle.cancel()
        with pytest.raises(RequestCancelled):
            await asyncio.wait_for(handle.result(), 10)
        await peer_state(engine, "b", "streams_open", 0)  # the decoder's worker dropped its ends
        await peer_state(engine, "a", "stream_lines", 0)  # the producer's worker its sending sessions


async def peer_state(engine, worker, key, want):
    """Wait until a worker's heartbeat reports peer-line figure `key` == `want`."""
    state = engine.cluster.workers[worker]
    deadline = time.monotonic() + 5
    while (state.load.get("peer") or {}).get(key) != want:
        assert time.monotonic() < deadline, (worker, key, want, state.load.get("peer"))
        await asyncio.sleep(0.02)
