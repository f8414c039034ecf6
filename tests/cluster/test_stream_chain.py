"""The three-stage streaming chain split across two worker processes gives the colocated outputs."""


import pytest
import torch
from mstar_fixture_plugin.chain import token_of

from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import Placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from tests.cluster.helpers import peer_figure, traffic

pytestmark = pytest.mark.timeout(120)


async def speak(engine, seed, length):
    handle = engine.submit("fixture-chain", {"seed": seed, "length": length})
    outs = [(out.name, out.value) async for out in handle]
    await handle.result()
    return outs


def traffic_all(engine):
    """{worker: traffic(engine, worker)} for every worker."""
    return {name: traffic(engine, name) for name in engine.cluster.workers}


def sent_since(after, before, worker):
    """{tag: count} the serving process sent `worker` between two `traffic` snapshots (tags that moved)."""
    was = before[worker]["sent"]
    counts = {t: n - was.get(t, [0, 0])[0] for t, (n, _) in after[worker]["sent"].items()}
    return {t: n for t, n in counts.items() if n}


REQUESTS = ((1, 9), (2, 14))


async def run_all(placement=None, check=None):
    engine = placed_engine(discover())
    await engine.load_model("fixture-chain", LoadOptions(preset="tiny"), placement=placement)
    try:
        before = traffic_all(engine) if engine.cluster else None
        outs = [await speak(engine, seed, length) for seed, length in REQUESTS]
        if check is not None:
            direct = {walk: sorted(plans) for walk, plans in engine._models["fixture-chain"].conductor.direct_streams.items()}
            await check(engine, direct, before, traffic_all(engine), outs)
        return outs
    finally:
        await engine.close()


_COLOCATED: list = []


async def colocated_outputs():
    """The colocated run's outputs (in this process, no workers), computed once for the file's tests."""
    if not _COLOCATED:
        _COLOCATED.append(await run_all())
    return _COLOCATED[0]


def frames_streamed(outs):
    """Items of the talker.frame stream: the non-empty frames (the edge keeps only those)."""
    return sum(1 for out in outs for name, v in out if name == "frame" and v.numel() > 0)


def assert_same(colocated, split):
    for (seed, length), a, b in zip(REQUESTS, colocated, split, strict=True):
        for name in ("frame", "wav"):  # the stages interleave differently; each output stream is identical
            mine, theirs = [v for n, v in a if n == name], [v for n, v in b if n == name]
            assert len(mine) == len(theirs) and all(torch.equal(x, y) for x, y in zip(mine, theirs, strict=True))
        wav = torch.cat([v for name, v in b if name == "wav"])
        assert torch.equal(wav, torch.tensor([2.0 * token_of(seed, i) for i in range(length)]))


async def test_the_chain_split_across_two_workers_matches_the_colocated_run():
    colocated = await colocated_outputs()
    # the producer on one worker (its loop delegated there), the consumer loop and the decoder on another

    async def check(engine, direct, before, after, outs):
        # gen -> talker goes worker to worker (the talker loop and its policy run on the talker worker); talker ->
        # window has both ends on the talker worker, which sends the frames to its own peer mailbox
        assert direct == {"speak": [0, 1]}
        frames = frames_streamed(outs)
        assert frames > 4
        assert await peer_figure(engine, "talker", "stream_received_items", 9 + 14 + frames) == 9 + 14 + frames
        assert await peer_figure(engine, "talker", "stream_sent_items", frames) == frames
        assert await peer_figure(engine, "thinker", "stream_sent_items", 9 + 14) == 9 + 14
        # no window reaches the talker worker as a node call: two consumers, two stream ends, one release each
        assert sent_since(after, before, "talker") == {"run_consumer": 4, "stream_end": 4, "release": 2}

    placement = Placement.from_dict({"workers": {"thinker": {}, "talker": {}},
                                     "nodes": {"gen": "thinker", "talker": "talker", "window": "talker"}})
    assert_same(colocated, await run_all(placement, check))


async def test_the_chain_across_three_workers_sends_each_stream_peer_to_peer():
    colocated = await colocated_outputs()

    async def check(engine, direct, before, after, outs):
        # talker.frame is produced by gen.item's consumer, which runs on the talker worker: it goes on from there
        assert direct == {"speak": [0, 1]}
        frames = frames_streamed(outs)
        assert await peer_figure(engine, "codec", "stream_received_items", frames) == frames
        assert await peer_figure(engine, "talker", "stream_sent_items", frames) == frames
        assert sent_since(after, before, "codec") == {"run_consumer": 2, "stream_end": 2, "release": 2}
        to_codec = sum(after["codec"]["sent"][t][1] - before["codec"]["sent"].get(t, [0, 0])[1]
                       for t in after["codec"]["sent"])
        assert to_codec < 2_000, to_codec  # ids and small env values; never a window of frames
        # with the stream kept here (the fallback), every window goes to the codec as a node call
        conductor = engine._models["fixture-chain"].conductor
        plans = conductor.direct_streams["speak"]
        conductor.direct_streams["speak"] = {0: plans[0]}
        try:
            before = traffic_all(engine)
            again = [await speak(engine, seed, length) for seed, length in REQUESTS]
            windows = sum(1 for out in again for name, _ in out if name == "wav")
            assert sent_since(traffic_all(engine), before, "codec") == {"invoke_node": windows, "release": 2}
            assert_same(outs, again)
        finally:
            conductor.direct_streams["speak"] = plans

    placement = Placement.from_dict({"workers": {"thinker": {}, "talker": {}, "codec": {}},
                                     "nodes": {"gen": "thinker", "talker": "talker", "window": "codec"}})
    assert_same(colocated, await run_all(placement, check))
