"""Per-walk placement of a node split across ranks: a moved cache carries every rank's KV heads.

The prefill runs on one worker group, the decode on another; between them the request's cache moves
with the heads of every rank (gathered to rank 0 on export, handed out by rank 0 on import). A snapshot
holds the whole model's heads, so groups of different sizes trade caches too: TP=2 to TP=2, TP=2 to a
single process and back. Greedy and seeded-sampled tokens must be those of the colocated model.
"""

from __future__ import annotations

import pytest

from mstar_core.config import Placement
from tests.cluster.test_per_walk_placement import generate

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
