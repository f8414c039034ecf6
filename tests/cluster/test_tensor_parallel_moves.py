"""Per-walk placement of a node split across ranks: a moved cache carries every rank's KV heads.

The prefill runs on one worker group, the decode on another; between them the request's cache moves
with the heads of every rank (gathered to rank 0 on export, handed out by rank 0 on import). A snapshot
holds the whole model's heads, so groups of different sizes trade caches too: TP=2 to TP=2, TP=2 to a
single process and back. Greedy and seeded-sampled tokens must be those of the colocated model.
"""

from __future__ import annotations

import pytest

from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import Placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from tests.cluster.test_per_walk_placement import REQUESTS, choices, generate
from tests.cluster.tp_checkpoints import make_hf, write_checkpoint

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

SIDES = {"tp2": {"device": "cpu", "tensor_parallel": 2, "threads": 1}, "tp1": {"device": "cpu", "threads": 1}}


@pytest.mark.parametrize(("prefill", "decode"), [("tp2", "tp2"), ("tp2", "tp1"), ("tp1", "tp2")])
async def test_a_cache_moved_between_groups_gives_the_colocated_tokens(prefill, decode):
    colocated, _, _ = await generate()
    split = Placement.from_dict({"workers": {"prefill": SIDES[prefill], "decode": SIDES[decode]},
                                 "nodes": {"lm": {"prefill": "prefill", "decode": "decode"}}}, "moves.yaml")
    moved, workers, _ = await generate(split)  # (it also checks every worker's pool is free again)
    assert {"prefill", "decode"} <= set(workers)
    assert moved == colocated


async def test_choices_forked_from_a_cache_moved_into_a_group_give_the_colocated_choices():
    # the prefill's cache moves into a TP=2 group, where n choices fork it: copy-on-write copies of
    # imported pages that every rank applies to its own heads
    split = Placement.from_dict({"workers": {"p": SIDES["tp2"], "d": SIDES["tp2"]},
                                 "nodes": {"lm": {"prefill": "p", "decode": "d", "prefill_shared": "p",
                                                  "choices": "d"}}}, "moves.yaml")
    colocated = await choices()
    assert sorted(colocated) == [0, 1, 2] and all(len(t) == 8 for t in colocated.values())
    assert await choices(split) == colocated


async def test_a_replicated_kv_head_moves_once_between_group_sizes(tmp_path):
    """One KV head over 2 ranks (each keeps it): the exported cache holds it once, so it moves to one process and
    back; tokens are the colocated model's."""
    checkpoint = write_checkpoint(make_hf("llama_mqa"), tmp_path / "mqa")

    async def run(placement=None) -> list[list[int]]:
        engine = placed_engine(discover())
        await engine.load_model("llama", LoadOptions(checkpoint=str(checkpoint)), placement=placement)
        try:
            return [[o.value async for o in engine.submit("llama", dict(r)) if o.name == "next_token"]
                    for r in REQUESTS]
        finally:
            await engine.close()

    colocated = await run()
    assert all(colocated)
    for prefill, decode in (("tp2", "tp1"), ("tp1", "tp2"), ("tp2", "tp2")):
        split = Placement.from_dict({"workers": {"prefill": SIDES[prefill], "decode": SIDES[decode]},
                                     "nodes": {"lm": {"prefill": "prefill", "decode": "decode"}}}, "moves.yaml")
        assert await run(split) == colocated, (prefill, decode)
