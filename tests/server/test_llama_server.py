"""Chat over the tiny `llama` preset through the generic tokenizer chat adapter, driven by the openai client."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.server.helpers import Server

pytest.importorskip("mstar_llm")
pytest.importorskip("mstar_kvcache")


@pytest.fixture(scope="module")
def llama():
    srv = Server(["llama"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(llama):
    return OpenAI(base_url=f"{llama.url}/v1", api_key=llama.api_key, max_retries=0, timeout=120)


def test_llama_chat_stream_equals_non_stream_and_usage(client):
    messages = [{"role": "developer", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model="llama", messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens <= 12 and whole.usage.prompt_tokens > 5
    if whole.choices[0].finish_reason == "length":
        assert whole.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model="llama", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_llama_seeded_sampling_is_reproducible(client):
    kw = dict(model="llama", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=10,
              temperature=1.0, top_p=0.9)
    a = client.chat.completions.create(seed=11, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=11, **kw).choices[0].message.content
    assert a == b


def test_llama_bad_field_is_a_400(client):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "x"}], top_p=0)
    assert "top_p" in str(info.value)
