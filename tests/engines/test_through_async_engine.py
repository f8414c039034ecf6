"""The kvcache engine behind the real runtime: `ar_walks` through `AsyncEngine`, streaming and cancellation."""

from __future__ import annotations

import asyncio

from mstar_kvcache import ar_walks

from mstar_core.graph import Graph, GraphNode
from mstar_core.model import LoadedModel
from mstar_core.runtime import AsyncEngine
from mstar_core.sampling import SamplingParams
from tests.engines.helpers import hf_greedy


def _loaded(model) -> LoadedModel:
    node = GraphNode("lm", inputs=("input_ids",), outputs=("next_token", "finish_reason"), engine="kvcache",
                     optional_inputs=("sampling",), module=lambda: model)
    graph = Graph.build("tinyllm", [node], ar_walks("lm"), plan=lambda inputs: ["prefill", "decode"])
    return LoadedModel("tinyllm", graph, random_weights=True)


def test_concurrent_requests_stream_hf_tokens_and_cancel_frees_pages(llama_pair):
    hf, ours = llama_pair
    prompts = [[1, 2, 3], list(range(10, 31)), [7] * 9]

    async def main():
        engine = AsyncEngine()
        await engine.add_model(_loaded(ours), settings={"lm": {"num_pages": 64, "page_size": 4}})
        try:
            handles = [engine.submit("tinyllm", {"input_ids": p, "sampling": SamplingParams(max_tokens=16)})
                       for p in prompts]

            async def collect(h):
                return [o.value for o in [o async for o in h] if o.name == "next_token"], await h.result()

            results = await asyncio.gather(*(collect(h) for h in handles))
            kv = engine.node_engines("tinyllm")["lm"]
            assert kv.pool.num_used == 0 and not kv.active_requests()
            long = engine.submit("tinyllm", {"input_ids": list(range(1, 40)), "sampling": SamplingParams(max_tokens=200)})
            async for out in long:
                if out.name == "next_token":
                    break
            long.cancel()
            for _ in range(100):
                if kv.pool.num_used == 0 and not kv.active_requests():
                    break
                await asyncio.sleep(0.02)
            assert kv.pool.num_used == 0 and not kv.active_requests()
            return results
        finally:
            await engine.close()

    results = asyncio.run(main())
    for prompt, (streamed, env) in zip(prompts, results, strict=True):
        assert streamed == hf_greedy(hf, prompt, 16)
        assert env["finish_reason"] == "length"
