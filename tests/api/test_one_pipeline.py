"""Chat, completions, responses and a realtime text turn go through the one request pipeline: with the same prompt,
the same sampling fields and seed, the tiny `llama` preset gives the same token ids on all of them.

The server runs in-process (FastAPI's TestClient). What the model was asked is read where the engine prepares it
(the rendered prompt's `input_ids`), and what it answered where the pipeline assembles text (`TextAssembler`), so
the comparison is on token ids, not on text that could decode alike from different ids. Completions takes a raw
prompt: it gets the ids the chat template rendered for the chat request, as token ids (`prompt: [ids]`).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from mstar_core.api.requests.text import TextAssembler

pytest.importorskip("mstar_llm")

PROMPT = "Name three colours of the rainbow."
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def served(monkeypatch_module):
    from fastapi.testclient import TestClient

    from mstar_core.api.server.app import ModelToServe, ServerConfig, create_app
    from mstar_core.model import LoadOptions
    from mstar_core.plugins.manager import discover
    from mstar_core.runtime import AsyncEngine

    assemblers: list[TextAssembler] = []
    original_init = TextAssembler.__init__

    def recording_init(self, *args: Any, **kw: Any) -> None:
        original_init(self, *args, **kw)
        assemblers.append(self)

    monkeypatch_module.setattr(TextAssembler, "__init__", recording_init)
    config = ServerConfig(models=[ModelToServe("llama", LoadOptions(preset="tiny"))])
    app = create_app(config, lambda: AsyncEngine(discover()))
    with TestClient(app) as client:
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        engine = app.state.mstar.engine
        prepared: list[dict[str, Any]] = []
        original_prepare = engine.prepare

        async def recording_prepare(model: str, inputs: Any) -> dict[str, Any]:
            out = await original_prepare(model, inputs)
            prepared.append(out)
            return out

        monkeypatch_module.setattr(engine, "prepare", recording_prepare)
        yield client, assemblers, prepared


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _asked_and_answered(served, send) -> tuple[list[int], list[int], str | None]:
    """(the prompt ids the engine prepared, the generated ids, finish reason) of the one request `send()` makes."""
    client, assemblers, prepared = served
    n_asm, n_prep = len(assemblers), len(prepared)
    send(client)
    assert len(prepared) == n_prep + 1 and len(assemblers) == n_asm + 1, "one request, one assembled answer"
    text = assemblers[-1]
    prompt = [int(t) for t in prepared[-1]["input_ids"]]
    return prompt, list(text.ids), text.finish_reason


def _chat(sampling: dict[str, Any]):
    def send(client):
        r = client.post("/v1/chat/completions", json={"model": "llama", "messages": [{"role": "user", "content": PROMPT}],
                                                       "max_tokens": MAX_TOKENS, **sampling})
        assert r.status_code == 200, r.text
    return send


def _completions(prompt_ids: list[int], sampling: dict[str, Any]):
    def send(client):
        r = client.post("/v1/completions", json={"model": "llama", "prompt": prompt_ids, "max_tokens": MAX_TOKENS,
                                                  **sampling})
        assert r.status_code == 200, r.text
    return send


def _responses(sampling: dict[str, Any]):
    def send(client):
        r = client.post("/v1/responses", json={"model": "llama", "input": PROMPT, "max_output_tokens": MAX_TOKENS,
                                                "store": False, **sampling})
        assert r.status_code == 200, r.text
    return send


def _realtime(sampling: dict[str, Any]):
    def send(client):
        with client.websocket_connect("/v1/realtime?model=llama") as ws:
            assert ws.receive_json()["type"] == "session.created"
            ws.send_json({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": PROMPT}]}})
            ws.send_json({"type": "response.create", "response": {
                "output_modalities": ["text"], "max_output_tokens": MAX_TOKENS, **sampling}})
            while True:
                event = ws.receive_json()
                assert event["type"] != "error", event
                if event["type"] == "response.done":
                    assert event["response"]["status"] in ("completed", "incomplete"), event
                    return
    return send


def test_greedy_chat_completions_responses_and_realtime_give_the_same_token_ids(served):
    greedy = {"temperature": 0}
    chat_prompt, chat_ids, chat_end = _asked_and_answered(served, _chat(greedy))
    assert chat_ids, "the model generated nothing to compare"
    results = {
        "completions": _asked_and_answered(served, _completions(chat_prompt, greedy)),
        "responses": _asked_and_answered(served, _responses(greedy)),
        "realtime": _asked_and_answered(served, _realtime(greedy)),
    }
    for route, (prompt, ids, end) in results.items():
        assert prompt == chat_prompt, f"{route} asked the model something else than chat"
        assert ids == chat_ids, f"{route} answered {ids}, chat {chat_ids}"
        assert end == chat_end, route


def test_seeded_sampling_gives_the_same_token_ids_on_every_route_that_takes_a_seed(served):
    # the Realtime API takes no seed or top_p (OpenAI's protocol): the greedy test above covers it
    sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 11}
    chat_prompt, chat_ids, chat_end = _asked_and_answered(served, _chat(sampled))
    for route, send in (("completions", _completions(chat_prompt, sampled)), ("responses", _responses(sampled))):
        prompt, ids, end = _asked_and_answered(served, send)
        assert prompt == chat_prompt and ids == chat_ids and end == chat_end, route
    # another seed samples something else (so the seed is what made them agree)
    _, other, _ = _asked_and_answered(served, _chat({**sampled, "seed": 12}))
    assert other != chat_ids
