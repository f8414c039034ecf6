"""Per-walk placement: a Llama's prefill on one worker, its decode on another; the KV cache moves between them."""

import asyncio
from pathlib import Path

import pytest

from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import Placement, load_placement
from mstar_core.errors import ConfigError
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from tests.cluster.helpers import kv_pages_used

pytestmark = pytest.mark.timeout(180)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "placement" / "llama-prefill-decode.yaml"
REQUESTS = [
    {"input_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], "max_tokens": 24,
     "ignore_eos": True},
    {"input_ids": [30, 31, 32], "max_tokens": 20, "temperature": 0.9, "top_p": 0.95, "seed": 11, "ignore_eos": True},
]


async def generate(placement=None):
    engine = placed_engine(discover())
    await engine.load_model("llama", LoadOptions(preset="tiny"), placement=placement)
    try:
        outs = []
        for request in REQUESTS:
            handle = engine.submit("llama", dict(request))
            outs.append([out.value async for out in handle if out.name == "next_token"])
        workers = sorted(engine.cluster.workers) if engine.cluster else []
        for name in workers:  # both workers' pools are free again (the prefill's pages left with the export)
            assert await kv_pages_used(engine, name, "llama/lm") == 0, name
        meta = {p.is_meta for p in engine.models["llama"].graph.nodes["lm"].module().parameters()}
        return outs, workers, meta
    finally:
        await engine.close()


async def test_prefill_and_decode_on_different_workers_give_the_colocated_tokens():
    colocated, _, _ = await generate()
    split, workers, meta = await generate(load_placement(EXAMPLE))
    assert workers == ["decode", "prefill"]
    assert split == colocated and [len(t) for t in split] == [24, 20]
    assert meta == {True}  # the serving process holds no weights: every walk of the only node runs in a worker


async def test_per_walk_placement_is_checked_against_the_model():
    engine = placed_engine(discover())
    bad_walk = {"workers": {"p": {}}, "nodes": {"lm": {"prefil": "p"}}}
    with pytest.raises(ConfigError, match="unknown walk 'prefil'.*walks: .*decode.*prefill"):
        await engine.load_model("llama", LoadOptions(preset="tiny"), placement=Placement.from_dict(bad_walk))
    with pytest.raises(ConfigError, match=r"nodes.lm.decode names unknown worker 'x'"):
        Placement.from_dict({"workers": {"p": {}}, "nodes": {"lm": {"decode": "x"}}})
    await engine.close()


async def test_a_node_whose_engine_cannot_move_state_cannot_be_placed_per_walk():
    pytest.importorskip("mstar_orpheus")
    engine = placed_engine(discover())
    placement = Placement.from_dict({"workers": {"c": {}}, "nodes": {"snac": {"decode": "c"}}})
    with pytest.raises(ConfigError, match="'snac' runs on the 'stateless' engine, which cannot move"):
        await engine.load_model("orpheus", LoadOptions(preset="tiny"), placement=placement)
    await engine.close()


async def test_requests_cancelled_before_during_and_after_the_move_free_both_workers():
    engine = placed_engine(discover())
    await engine.load_model("llama", LoadOptions(preset="tiny"), placement=load_placement(EXAMPLE))
    try:
        prompt = list(range(5, 60))
        handles = [engine.submit("llama", {"input_ids": prompt, "max_tokens": 400, "ignore_eos": True}) for _ in range(6)]
        handles[0].cancel()  # before its prefill ran
        seen = [0] * len(handles)

        async def read(i, handle, stop_after):
            async for out in handle:
                seen[i] += out.name == "next_token"
                if seen[i] >= stop_after:
                    handle.cancel()  # mid-decode, on the decode worker

        stops = [1, 1, 2, 5, 30, 10_000]  # 1: right after the prefill's token, as the move starts
        # a long prompt prefills in several chunks on the prefill worker: cancelled there, most likely
        long = engine.submit("llama", {"input_ids": [i % 400 + 3 for i in range(1900)], "max_tokens": 50, "ignore_eos": True})
        await asyncio.sleep(0.02)
        long.cancel()
        results = await asyncio.gather(*(read(i, h, s) for i, (h, s) in enumerate(zip(handles, stops, strict=True))),
                                       return_exceptions=True)
        assert seen[-1] == 400 and not isinstance(results[-1], BaseException)
        for name in ("prefill", "decode"):
            assert await kv_pages_used(engine, name, "llama/lm") == 0, name
        assert engine.running == 0
    finally:
        await engine.close()


CHOICES = {"input_ids": list(range(5, 30)), "max_tokens": 8, "temperature": 0.9, "seed": 3, "n": 3, "ignore_eos": True}


async def choices(placement=None) -> dict[int, list[int]]:
    """The tokens of each of `CHOICES`' 3 sampled choices, by branch."""
    engine = placed_engine(discover())
    await engine.load_model("llama", LoadOptions(preset="tiny"), placement=placement)
    try:
        out: dict[int, list[int]] = {}
        async for o in engine.submit("llama", dict(CHOICES)):
            if o.name == "next_token":
                out.setdefault(o.branch, []).append(o.value)
        return out
    finally:
        await engine.close()


async def test_n_choices_forked_after_a_prefill_on_another_worker_give_the_colocated_choices():
    # the choices' branches reach the decode worker together: one moves the state, the others wait
    # for it (they used to fork a label not there yet), and their loops are told apart
    colocated = await choices()
    split = await asyncio.wait_for(choices(load_placement(EXAMPLE)), 120)
    assert sorted(colocated) == [0, 1, 2] and all(len(t) == 8 for t in colocated.values())
    assert split == colocated
