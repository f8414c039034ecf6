"""The official `openai` client's realtime connection against `mstar serve --config examples/voice-agent.yaml`:
speech in (espeak-ng), its transcript, the reply's text and audio out; a second turn that prefills only its new
tokens; barge-in cancelling the whole chain at once and truncating the reply at the audio sent."""

from __future__ import annotations

import asyncio
import base64
import time
from pathlib import Path

import pytest

from tests.realtime.helpers import b64, client, node_stat, types, until
from tests.voice_agent.speech import silence, speech

pytest.importorskip("openai")
pytest.importorskip("websockets")
pytest.importorskip("mstar_whisper")
pytest.importorskip("mstar_qwen_tts")

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "voice-agent.yaml"
VAD = {"type": "server_vad", "threshold": 0.5, "silence_duration_ms": 400, "prefix_padding_ms": 200,
       "create_response": True, "interrupt_response": True}


@pytest.fixture(scope="module")
def agent_server():
    from tests.server.helpers import Server

    srv = Server([], "--config", str(CONFIG), MSTAR_REALTIME_VAD="energy")
    yield srv
    assert srv.stop() == 0, srv.output()[-3000:]
    assert "Traceback" not in srv.serving_output(), srv.serving_output()[-3000:]


async def _open(conn, **session):
    assert (await conn.recv()).type == "session.created"
    await conn.session.update(session={"type": "realtime", **session})
    ev = await conn.recv()
    assert ev.type == "session.updated", ev
    return ev.session


@pytest.mark.slow  # a server of three models and four turns: about 40 s on a loaded 2-core box
def test_spoken_turns_a_second_turn_prefilling_only_itself_and_barge_in(agent_server):
    async def go():
        out = {}
        async with client(agent_server).realtime.connect(model="agent") as conn:
            session = await _open(conn, output_modalities=["audio"], max_output_tokens=24,
                                  audio={"input": {"turn_detection": VAD}})
            out["session"] = session
            # turn 1: speech, then silence: the server's VAD ends the turn and answers in one request
            for chunk in (silence(0.3), speech(), silence(0.8)):
                await conn.input_audio_buffer.append(audio=b64(chunk))
            seen: list = []
            out["done1"] = await until(conn, "response.done", seen)
            out["seen1"] = seen
            # turn 2, in text: the conversation so far (transcript, reply as generated) is in the KV cache
            before = node_stat(agent_server, "llama", "lm", "tokens_forwarded")
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "And tomorrow?"}]})
            await until(conn, "conversation.item.done")
            await conn.response.create(response={"output_modalities": ["text"]})
            out["done2"] = await until(conn, "response.done")
            out["forwarded2"] = node_stat(agent_server, "llama", "lm", "tokens_forwarded") - before
            # turn 3: a long spoken reply, interrupted by the user's speech as soon as its audio starts
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Tell me a long story."}]})
            await until(conn, "conversation.item.done")
            await conn.response.create(response={"max_output_tokens": 400})
            seen3: list = []
            await until(conn, "response.output_audio.delta", seen3)
            await conn.input_audio_buffer.append(audio=b64(speech("Wait, stop.")))
            await until(conn, "input_audio_buffer.speech_started", seen3)
            t0 = time.perf_counter()
            out["done3"] = await until(conn, "response.done", seen3)
            out["barge_ms"] = (time.perf_counter() - t0) * 1000
            out["seen3"] = seen3
        await asyncio.sleep(0.3)
        out["pages"] = {(m, n): node_stat(agent_server, m, n, "kv_pages_used")
                        for m, n in (("llama", "lm"), ("qwen3-tts", "talker"), ("whisper", "decoder"))}
        return out

    out = asyncio.run(go())
    seen1, order1 = out["seen1"], types(out["seen1"])
    for kind in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                 "input_audio_buffer.committed", "response.created",
                 "conversation.item.input_audio_transcription.completed", "response.output_audio.delta",
                 "response.output_audio_transcript.delta", "response.done"):
        assert kind in order1, (kind, order1)
    assert order1.index("conversation.item.input_audio_transcription.completed") < \
        order1.index("response.output_audio_transcript.delta")
    transcribed = next(e for e in seen1 if e.type == "conversation.item.input_audio_transcription.completed")
    committed = next(e for e in seen1 if e.type == "input_audio_buffer.committed")
    assert transcribed.item_id == committed.item_id and isinstance(transcribed.transcript, str)
    done1 = out["done1"].response
    assert done1.status in ("completed", "incomplete") and done1.usage.input_tokens > 0
    audio = sum(len(base64.b64decode(e.delta)) // 2 for e in seen1 if e.type == "response.output_audio.delta")
    assert audio > 0
    reply_tokens = done1.usage.output_tokens

    done2 = out["done2"].response
    assert done2.status in ("completed", "incomplete") and done2.output[0].content[0].text is not None
    new_prompt = done2.usage.input_tokens - done1.usage.input_tokens - reply_tokens
    decode_steps = done2.usage.output_tokens - 1
    prefilled = out["forwarded2"] - decode_steps
    # turn 2 computes its new tokens only (its user turn, the template's joins, a partly filled page at most)
    assert prefilled <= new_prompt + 2 + 16, (prefilled, new_prompt, out["forwarded2"])
    assert prefilled < done2.usage.input_tokens // 2

    done3 = out["done3"].response
    assert done3.status == "cancelled" and done3.status_details.reason == "turn_detected"
    assert out["barge_ms"] < 1000, out["barge_ms"]
    sent = sum(len(base64.b64decode(e.delta)) // 2 for e in out["seen3"] if e.type == "response.output_audio.delta")
    truncated = next((e for e in out["seen3"] if e.type == "conversation.item.truncated"), None)
    assert truncated is not None and truncated.audio_end_ms <= sent * 1000 // 24000 + 1
    assert all(v == 0 for v in out["pages"].values()), out["pages"]  # every part's pages are back
