"""The tiny Qwen3-Omni preset ends its realtime turns by itself: with no `max_output_tokens`, a spoken (audio out)
conversation of five turns gets status `completed` (its Thinker wrote <|im_end|>) in at least four, each within a
few dozen text tokens. Before, its random weights made <|im_end|> one token among hundreds and every turn ran to
the limit. The preset's weights do it (`mstar_qwen_omni.preset.end_turns_by_themselves`), not the server."""

from __future__ import annotations

import asyncio

import pytest

from tests.realtime.helpers import client, until

pytest.importorskip("openai")
pytest.importorskip("websockets")
TURNS = ["Hello there!", "How are you today?", "Tell me about the weather.", "What is a fox?", "Thank you, bye."]


# the model's default (greedy), and sampled; the greedy run speaks longer (slow on CI's cores)
@pytest.mark.parametrize("temperature", [pytest.param(None, marks=pytest.mark.slow), 0.8])
def test_five_spoken_turns_end_by_themselves(rt_server, temperature):
    async def go():
        async with client(rt_server).realtime.connect(model="qwen3-omni") as conn:
            assert (await conn.recv()).type == "session.created"
            session = {"type": "realtime", "audio": {"input": {"turn_detection": None}}}
            await conn.session.update(session=session)
            assert (await conn.recv()).type == "session.updated"
            done = []
            for text in TURNS:
                await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": text}]})
                await until(conn, "conversation.item.done")
                await conn.response.create(response={} if temperature is None else {"temperature": temperature})
                done.append((await until(conn, "response.done", [])).response)
            return done

    responses = asyncio.run(asyncio.wait_for(go(), 300))
    completed = [r for r in responses if r.status == "completed"]
    assert len(completed) >= 4, [(r.status, r.status_details) for r in responses]
    for r in completed:
        assert 1 <= r.usage.output_token_details.text_tokens <= 48
        assert r.output[0].content[0].type == "output_audio"
