"""First contact with `mstar serve llama` (the tiny preset, no options): the official `openai` client sending only
what a newcomer sends gets text back on chat, completions and streaming chat. Before, a chat reply was 256 tokens
decoding to '': greedily (the default) the random tied embeddings looped on <|im_start|>, and sampled, on the
ids the vocabulary is padded with past the tokenizer (as real checkpoints pad)."""

from __future__ import annotations

import json

import pytest

from tests.server.helpers import Server

openai = pytest.importorskip("openai")
pytest.importorskip("mstar_llm")
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def client():
    server = Server(["llama"], api_key=None, plugins=())
    try:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        server.stop()


def _has_text(text: str | None, finish_reason: str, tokens: int) -> bool:
    """Text came back, unless the model stopped at once (its end-of-turn token first: nothing to decode)."""
    return bool(text) or (finish_reason == "stop" and tokens <= 1)


def test_chat_hello_has_content(client):
    r = client.chat.completions.create(model="llama", messages=HELLO)
    choice = r.choices[0]
    assert r.usage.completion_tokens > 0 and choice.finish_reason in ("stop", "length")
    assert _has_text(choice.message.content, choice.finish_reason, r.usage.completion_tokens), r.model_dump()


def test_completion_hello_has_text(client):
    r = client.completions.create(model="llama", prompt="Hello")
    choice = r.choices[0]
    assert _has_text(choice.text, choice.finish_reason, r.usage.completion_tokens), r.model_dump()


def test_streamed_chat_has_content(client):
    chunks = list(client.chat.completions.create(model="llama", messages=HELLO, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["stop"], ["length"]) and (text or finish == ["stop"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampled_chat_hello_has_content(client, seed):
    r = client.chat.completions.create(model="llama", messages=HELLO, temperature=1.0, seed=seed)
    choice = r.choices[0]
    assert _has_text(choice.message.content, choice.finish_reason, r.usage.completion_tokens), r.model_dump()


def test_json_object_reply_opens_an_object(client):
    r = client.chat.completions.create(model="llama", messages=HELLO, response_format={"type": "json_object"})
    choice = r.choices[0]
    assert choice.message.content.startswith("{")
    if choice.finish_reason == "stop":  # a reply cut by max_tokens is a prefix of an object, not one
        assert isinstance(json.loads(choice.message.content), dict)
