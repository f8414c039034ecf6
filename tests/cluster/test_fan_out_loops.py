"""Loops inside fan-out branches run on the worker that hosts their node, each branch's copy told apart."""

import asyncio
from pathlib import Path

import pytest

from mstar_core.cluster.remote_loop import RemoteLoop
from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import load_placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.runtime.conductor import Conductor
from tests.cluster.helpers import kv_pages_used

pytestmark = pytest.mark.timeout(180)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "placement" / "llama-prefill-decode.yaml"
REQUESTS = [
    {"input_ids": list(range(5, 30)), "max_tokens": 8, "temperature": 0.9, "seed": 3, "n": 3, "ignore_eos": True},
    {"input_ids": [40, 41, 42, 43], "max_tokens": 6, "n": 2, "ignore_eos": True},  # greedy: both choices equal
]


def count_loops(monkeypatch):
    """Where the choices' decode loops ran: delegated (by branch) or here, one call at a time."""
    seen = {"delegated": [], "local": []}
    delegated_run, local_run = RemoteLoop.run, Conductor.run_loop

    async def delegated(self, conductor, state, frame, loop, env):
        seen["delegated"].append((self.walk.name, frame.branch_key))
        await delegated_run(self, conductor, state, frame, loop, env)

    async def local(self, state, frame, site, env):
        seen["local"].append(site.walk)
        await local_run(self, state, frame, site, env)

    monkeypatch.setattr(RemoteLoop, "run", delegated)
    monkeypatch.setattr(Conductor, "run_loop", local)
    return seen


async def choices(placement=None):
    engine = placed_engine(discover())
    await engine.load_model("llama", LoadOptions(preset="tiny"), placement=placement)
    try:
        outs = []
        for request in REQUESTS:
            out: dict[int, list[int]] = {}
            async for o in engine.submit("llama", dict(request)):
                if o.name == "next_token":
                    out.setdefault(o.branch, []).append(o.value)
            outs.append(out)
        for name in sorted(engine.cluster.workers) if engine.cluster else []:
            assert await kv_pages_used(engine, name, "llama/lm") == 0, name
        return outs
    finally:
        await engine.close()


async def test_fan_out_branches_loops_delegated_to_a_worker_equal_the_colocated_run(monkeypatch):
    colocated = await choices()
    seen = count_loops(monkeypatch)
    split = await asyncio.wait_for(choices(load_placement(EXAMPLE)), 150)
    assert [sorted(c) for c in colocated] == [[0, 1, 2], [0, 1]]
    assert colocated[1][0] == colocated[1][1] and colocated[0][0] != colocated[0][1]
    assert split == colocated
    # every branch's decode loop ran on the decode worker at once (same loop index, told apart by branch)
    assert sorted(seen["delegated"]) == [("choices", "0"), ("choices", "0"), ("choices", "1"), ("choices", "1"),
                                         ("choices", "2")]
    assert "choices" not in seen["local"]


async def test_cancelling_fan_out_requests_mid_loop_frees_every_worker(monkeypatch):
    seen = count_loops(monkeypatch)
    engine = placed_engine(discover())
    await engine.load_model("llama", LoadOptions(preset="tiny"), placement=load_placement(EXAMPLE))
    try:
        request = {"input_ids": list(range(5, 40)), "max_tokens": 400, "n": 3, "temperature": 0.8, "seed": 1,
                   "ignore_eos": True}
        handles = [engine.submit("llama", dict(request)) for _ in range(3)]
        counts = [0] * len(handles)

        async def read(i, handle, stop_after):
            async for out in handle:
                counts[i] += out.name == "next_token"
                if counts[i] >= stop_after:
                    handle.cancel()  # mid-loop: the branches' loops are running on the decode worker

        await asyncio.gather(*(read(i, h, s) for i, (h, s) in enumerate(zip(handles, (2, 9, 20), strict=True))),
                             return_exceptions=True)
        assert all(c < 3 * 400 for c in counts)
        assert len(seen["delegated"]) >= 3  # at least the first request's branches were running remotely
        for name in ("prefill", "decode"):
            assert await kv_pages_used(engine, name, "llama/lm") == 0, name
        assert engine.running == 0
        # the engine still serves a whole request afterwards
        out = [o.value async for o in engine.submit("llama", {"input_ids": [7, 8, 9], "max_tokens": 4, "n": 2,
                                                              "ignore_eos": True}) if o.name == "next_token"]
        assert len(out) == 8
    finally:
        await engine.close()
