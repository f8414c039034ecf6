"""LoRA adapters served by the runtime: `model=<adapter>` runs the base model under it, rows of several adapters in
one step, prefix pages kept apart per adapter, adapter steps never replayed, load and unload."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from mstar_core.config.lora import LoraSettings
from mstar_core.errors import ConfigError, RequestError
from mstar_core.model import LoadOptions

PROMPT = [5, 17, 33, 40, 8, 9, 100, 12, 61, 7, 3, 90, 14, 15, 16, 200, 201, 44, 45, 46, 47]  # over one 16-token page


@pytest.fixture
async def engine(tiny_adapters):
    from mstar_core.runtime import AsyncEngine

    tiny, adapters = tiny_adapters
    engine = AsyncEngine()
    await engine.load_model("llama", LoadOptions(checkpoint=str(tiny)), alias="llama", settings={"lm": {"num_pages": 64}})
    await engine.enable_lora("llama", LoraSettings(adapters={"sql": str(adapters["sql"][0])}, max_loras=2,
                                                   max_lora_rank=8))
    await engine.load_lora_adapter("poet", str(adapters["poet"][0]))
    try:
        yield engine
    finally:
        await engine.close()


async def _tokens(engine, model, prompt=PROMPT, n=10):
    handle = await engine.submit_async(model, {"input_ids": prompt, "max_tokens": n, "ignore_eos": True})
    return [int(o.value) async for o in handle if o.name == "next_token"]


def _greedy_merged(peft_model, prompt, n, no_token):
    """transformers' greedy decoding over peft's merged weights (padding columns never chosen, as the engine does)."""
    merged = copy.deepcopy(peft_model).merge_and_unload().eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = merged(input_ids=torch.tensor([ids])).logits[0, -1]
            logits[no_token] = -float("inf")
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


async def test_adapter_by_model_name_decodes_as_peft_merged(engine, tiny_adapters):
    _, adapters = tiny_adapters
    no_token = list(engine.models["llama"].extras["grammar_vocab"].no_token_ids)
    base = await _tokens(engine, "llama")
    for name in ("sql", "poet"):
        got = await _tokens(engine, name)
        assert got == _greedy_merged(adapters[name][1], PROMPT, 10, no_token)
        assert got != base


async def test_mixed_batch_equals_each_alone(engine):
    models = ["sql", "llama", "poet", "sql", "poet", "llama", "poet", "sql"]
    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(len(models))]
    alone = [await _tokens(engine, m, p) for m, p in zip(models, prompts, strict=True)]
    lm = engine.node_engines("llama")["lm"]
    largest = lm.largest_batch
    mixed = await asyncio.gather(*(_tokens(engine, m, p) for m, p in zip(models, prompts, strict=True)))
    assert mixed == alone
    assert lm.largest_batch > max(largest, 2)  # they really shared steps


async def test_prefix_pages_stay_with_their_adapter(engine):
    lm = engine.node_engines("llama")["lm"]
    fresh = await _tokens(engine, "sql")  # the first request of this prompt under sql: nothing cached under it
    hits = lm.pool.hits
    await _tokens(engine, "llama")  # the base computes the same prompt: its pages are not sql's
    await _tokens(engine, "poet")
    assert lm.pool.hits == hits
    assert await _tokens(engine, "sql") == fresh
    assert lm.pool.hits > hits  # the same adapter again does reuse its own


async def test_adapter_steps_replay_with_their_deltas_or_run_eagerly(engine, tiny_adapters):
    """Where lora.cpp runs the deltas, a recorded step holds its calls and replays whatever the rows' adapters;
    where the deltas are torch ops (no kernel), a step with adapter rows never replays (it would drop them)."""
    lm = engine.node_engines("llama")["lm"]
    if lm.replay is None or not lm.adapters.bank.native:
        pytest.skip("no replayed steps or no LoRA kernel on this machine")
    no_token = list(engine.models["llama"].extras["grammar_vocab"].no_token_ids)
    want = _greedy_merged(tiny_adapters[1]["poet"][1], PROMPT, 8, no_token)
    replayed = lm.replay.replayed
    assert await _tokens(engine, "poet", n=8) == want
    assert await _tokens(engine, "poet", n=8) == want
    assert lm.replay.replayed > replayed  # replayed, with the deltas (the tokens are peft's)
    lm.adapters.bank.native = False  # as on a machine without the kernel: torch ops, eager steps
    try:
        await _tokens(engine, "llama", n=6)
        replayed = lm.replay.replayed
        assert await _tokens(engine, "poet", n=8) == want
        assert lm.replay.replayed == replayed
    finally:
        lm.adapters.bank.native = True


async def test_unload_frees_and_refuses_while_in_use(engine, tiny_adapters):
    _, adapters = tiny_adapters
    with pytest.raises(ConfigError, match="all 2 LoRA slots are taken"):
        await engine.load_lora_adapter("third", str(adapters["third"][0]))
    assert "third" not in engine.lora.adapters
    handle = await engine.submit_async("sql", {"input_ids": PROMPT, "max_tokens": 400, "ignore_eos": True})
    async for out in handle:
        if out.name == "next_token":
            break
    with pytest.raises(RequestError, match="'sql' is in use by 1 sequence") as err:
        await engine.unload_lora_adapter("sql")
    assert err.value.status == 409
    handle.cancel()
    with pytest.raises(RequestError):
        await handle.result()
    await engine.unload_lora_adapter("sql")
    assert "sql" not in engine.lora.adapters
    with pytest.raises(RequestError, match="model 'sql' is not loaded"):
        await _tokens(engine, "sql")
    await engine.load_lora_adapter("third", str(adapters["third"][0]))  # its slot is free again
    assert await _tokens(engine, "third") != await _tokens(engine, "llama")


async def test_names_and_bad_directories(engine, tmp_path):
    with pytest.raises(RequestError, match="'llama' is already the name of a served model or adapter"):
        await engine.load_lora_adapter("llama", str(tmp_path))
    with pytest.raises(ConfigError, match="missing file adapter_config.json"):
        await engine.load_lora_adapter("empty", str(tmp_path))
    with pytest.raises(RequestError, match="no LoRA adapter named 'nope'") as err:
        await engine.unload_lora_adapter("nope")
    assert err.value.status == 404


async def test_choices_fork_under_the_adapter(engine):
    """`n` choices fork the prompt's cache: the forks keep the adapter their prompt ran under."""
    alone = await _tokens(engine, "poet", n=6)
    handle = await engine.submit_async("poet", {"input_ids": PROMPT, "max_tokens": 6, "ignore_eos": True, "n": 2,
                                                "temperature": 0})
    by_branch: dict[int, list[int]] = {}
    async for out in handle:
        if out.name == "next_token":
            by_branch.setdefault(out.branch, []).append(int(out.value))
    assert by_branch == {0: alone, 1: alone}
