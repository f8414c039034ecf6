"""The three-stage streaming chain split across two worker processes gives the colocated outputs."""

import asyncio
import time

import pytest
import torch
from mstar_fixture_plugin.chain import token_of

from mstar_core.config import Placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.runtime import AsyncEngine

pytestmark = pytest.mark.timeout(120)


async def speak(engine, seed, length):
    handle = engine.submit("fixture-chain", {"seed": seed, "length": length})
    outs = [(out.name, out.value) async for out in handle]
    await handle.result()
    return outs


async def run_all(placement=None):
    engine = AsyncEngine(discover())
    await engine.load_model("fixture-chain", LoadOptions(preset="tiny"), placement=placement)
    try:
        outs = [await speak(engine, seed, length) for seed, length in ((1, 9), (2, 14))]
        if engine.cluster is None:
            return outs, None
        direct = {walk: sorted(plans) for walk, plans in engine._models["fixture-chain"].conductor.direct_streams.items()}
        talker = engine.cluster.workers["talker"]
        deadline = time.monotonic() + 10
        while (talker.load.get("peer") or {}).get("stream_received_items", 0) < 9 + 14:
            assert time.monotonic() < deadline, talker.load.get("peer")
            await asyncio.sleep(0.05)
        return outs, (direct, talker.load["peer"]["stream_received_items"])
    finally:
        await engine.close()


async def test_the_chain_split_across_two_workers_matches_the_colocated_run():
    colocated, _ = await run_all()
    # the producer on one worker (its loop delegated there), the consumer loop and the decoder on another
    placement = Placement.from_dict({"workers": {"thinker": {}, "talker": {}},
                                     "nodes": {"gen": "thinker", "talker": "talker", "window": "talker"}})
    split, (direct, received) = await run_all(placement)
    # gen -> talker goes worker to worker (the talker loop and its policy run on the talker worker); talker ->
    # window has both ends on one worker and stays with the serving process
    assert direct == {"speak": [0]} and received == 9 + 14
    for (seed, length), a, b in zip(((1, 9), (2, 14)), colocated, split, strict=True):
        for name in ("frame", "wav"):  # the stages interleave differently; each output stream is identical
            mine, theirs = [v for n, v in a if n == name], [v for n, v in b if n == name]
            assert len(mine) == len(theirs) and all(torch.equal(x, y) for x, y in zip(mine, theirs, strict=True))
        wav = torch.cat([v for name, v in b if name == "wav"])
        assert torch.equal(wav, torch.tensor([2.0 * token_of(seed, i) for i in range(length)]))
