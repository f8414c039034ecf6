"""A Llama-family node split over 2 gloo ranks, served over HTTP with a placement file.

Checkpoints come from transformers' `save_pretrained` (tests/cluster/tp_checkpoints.py). At TP=2 the
greedy tokens must equal TP=1's (the same node in one process) and transformers' `generate`, for
concurrent requests, a prefix-cache hit and `n: 2` choices (cache forks: copy-on-write page copies
that every rank must apply). Each rank's KV pool holds half the KV heads, and its weights are half
of the split ones plus every replicated one.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml

from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import Placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from tests.cluster.tp_checkpoints import CONFIGS, engine_greedy, hf_greedy, make_hf, write_checkpoint
from tests.server.helpers import Server

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

NEW = 14
PROMPTS = [list(range(3, 22)), [40, 41, 42], list(range(100, 137)), list(range(3, 22))]  # the last: a prefix hit
TP2 = {"workers": {"tp": {"device": "cpu", "tensor_parallel": 2, "threads": 1}}, "nodes": {"lm": "tp"}}


def _walk(url: str, inputs: dict) -> list[int]:
    """The `next_token`s of one native-endpoint request, as streamed (choices interleaved)."""
    body = {"inputs": {**inputs, "temperature": 0.0, "ignore_eos": True, "max_tokens": NEW}, "stream": True}
    tokens = []
    with httpx.stream("POST", f"{url}/v1/walks/llama", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            event = json.loads(line)
            assert event["event"] != "error", event
            if event["event"] == "output" and event["name"] == "next_token":
                tokens.append(event["value"])
    return tokens


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_tp2_over_http_gives_tp1_and_transformers_greedy_tokens(kind, tmp_path):
    hf = make_hf(kind)
    checkpoint = write_checkpoint(hf, tmp_path / kind)
    expected = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    assert asyncio.run(engine_greedy(checkpoint, PROMPTS, NEW))[0] == expected  # TP=1
    placement = tmp_path / "tp2.yaml"
    placement.write_text(yaml.safe_dump(TP2))
    srv = Server(["llama"], "--checkpoint", str(checkpoint), "--config", str(placement), api_key=None, wait=False)
    try:
        srv.wait_ready(timeout=180)
        with ThreadPoolExecutor(3) as pool:  # the first three at once: batched decode steps across both ranks
            got = list(pool.map(lambda p: _walk(srv.url, {"input_ids": p}), PROMPTS[:3]))
        got.append(_walk(srv.url, {"input_ids": PROMPTS[3]}))
        assert got == expected
        # two greedy choices from forks of one prefill (the stream interleaves them; per choice: the next test)
        assert sorted(_walk(srv.url, {"input_ids": PROMPTS[0], "n": 2})) == sorted(expected[0] * 2)
    finally:
        srv.stop()


async def test_each_rank_holds_half_the_kv_heads_and_its_share_of_the_weights(tmp_path):
    hf = make_hf("qwen3")
    checkpoint = write_checkpoint(hf, tmp_path / "qwen3")
    engine = placed_engine(discover())
    await engine.load_model("llama", LoadOptions(checkpoint=str(checkpoint)), placement=Placement.from_dict(TP2))
    try:
        handle = engine.submit("llama", {"input_ids": PROMPTS[0], "max_tokens": NEW, "ignore_eos": True, "n": 2,
                                         "temperature": 0.0})
        choices: dict = {}
        async for out in handle:
            if out.name == "next_token":
                choices.setdefault(out.branch, []).append(out.value)
        greedy = hf_greedy(hf, PROMPTS[0], NEW)
        assert list(choices.values()) == [greedy, greedy]  # each fork continues the shared prefill's pages
        loads = {}
        for name in ("tp", "tp.rank1"):
            state = engine.cluster.workers[name]
            for _ in range(100):
                if "kv_heads" in state.load.get("llama/lm", {}):
                    break
                await asyncio.sleep(0.05)
            loads[name] = state.load["llama/lm"]
    finally:
        await engine.close()
    cfg = hf.config
    params = dict(hf.named_parameters())
    replicated = sum(p.numel() * 4 for n, p in params.items() if "norm" in n)
    total = sum(p.numel() * 4 for p in params.values())
    per_page = 2 * cfg.num_hidden_layers * 16 * (cfg.num_key_value_heads // 2) * cfg.head_dim * 4
    for name, load in loads.items():
        assert load["tensor_parallel_size"] == 2 and load["kv_heads"] == cfg.num_key_value_heads // 2, (name, load)
        assert load["kv_pool_bytes"] == load["kv_pages_total"] * per_page, (name, load)
        assert load["parameter_bytes"] == (total - replicated) // 2 + replicated, (name, load)
    assert loads["tp"]["tokens_forwarded"] > 0 and loads["tp.rank1"]["tokens_forwarded"] == 0  # rank 0 decides
    assert loads["tp"]["kv_page_copies"] > 0  # the forks copied a shared page: a page op every rank applied
