"""Embedding AsyncEngine: it leaves torch's thread count alone; a held preparation stalls no other stream."""

import asyncio
import threading

import torch

from mstar_core.graph import DynamicLoop, Graph, Walk
from mstar_core.model import LoadedModel
from mstar_core.plugins import discover
from mstar_core.runtime import AsyncEngine
from tests.core.helpers import fn_node


def counting_model(prepare):
    node = fn_node("inc", "i", "i", lambda i: i + 1)
    walk = Walk(name="w", body=DynamicLoop(body="inc", until=lambda env: env["i"] >= env["n"], max_iters=10**9),
                inputs=("i", "n"), emit="i")
    return LoadedModel("count", Graph.build("count", [node], [walk]), prepare=prepare)


async def test_embedding_leaves_torch_threads_unchanged():
    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    torch.set_num_threads(target)
    try:
        engine = AsyncEngine(discover())
        await engine.add_model(counting_model(None))
        assert (await engine.generate("count", {"i": 0, "n": 3}))["i"] == 3
        assert torch.get_num_threads() == target
        await engine.close()
        assert torch.get_num_threads() == target
    finally:
        torch.set_num_threads(before)


async def test_a_held_preparation_does_not_stall_other_streams():
    release = threading.Event()
    entered = threading.Event()

    def prepare(inputs):
        if inputs.get("big"):
            entered.set()
            release.wait(30)  # a large upload being decoded: blocks until the test lets it go
        return {"i": 0, "n": inputs["n"]}

    engine = AsyncEngine(discover())
    await engine.add_model(counting_model(prepare))
    held = asyncio.ensure_future(engine.submit_async("count", {"big": True, "n": 2}))
    while not entered.is_set():
        await asyncio.sleep(0.001)
    try:
        other = await engine.submit_async("count", {"n": 50})
        seen = [out.value async for out in other]  # streams to its end while the other preparation is held
        assert seen == list(range(1, 51))
        assert not held.done()
    finally:
        release.set()
    assert (await (await held).result())["i"] == 2
    await engine.close()
