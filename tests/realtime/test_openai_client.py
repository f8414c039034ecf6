"""The official `openai` client's realtime connection against served models: text and audio turns, a second
turn that prefills only itself, cancel, server VAD with barge-in, and a tool call round trip."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import pytest

from tests.realtime.helpers import b64, client, node_stat, pages_used, silence, tone, types, until

pytest.importorskip("openai")
pytest.importorskip("websockets")


async def _open(conn, **session):
    assert (await conn.recv()).type == "session.created"
    await conn.session.update(session={"type": "realtime", **session})
    ev = await conn.recv()
    assert ev.type == "session.updated", ev
    return ev.session


async def _say(conn, text: str) -> None:
    await conn.conversation.item.create(item={"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": text}]})
    await until(conn, "conversation.item.done")


def test_text_turn_streams_the_reply(rt_server):
    async def go():
        async with client(rt_server).realtime.connect(model="toy-chat") as conn:
            session = await _open(conn, output_modalities=["text"], audio={"input": {"turn_detection": None}})
            assert session.output_modalities == ["text"]
            await _say(conn, "hello realtime")
            await conn.response.create()
            seen: list = []
            done = await until(conn, "response.done", seen)
            deltas = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
            text_done = next(e for e in seen if e.type == "response.output_text.done")
            return done, deltas, text_done, types(seen)

    done, deltas, text_done, order = asyncio.run(go())
    assert deltas == text_done.text == "hello realtime"  # toy-chat echoes the last user message
    assert order[0] == "response.created" and order[-1] == "response.done"
    for kind in ("response.output_item.added", "conversation.item.added", "response.content_part.added",
                 "response.content_part.done", "response.output_item.done", "conversation.item.done"):
        assert kind in order, kind
    assert done.response.status == "completed"
    assert done.response.output[0].content[0].text == "hello realtime"
    assert done.response.usage.output_tokens == len("hello realtime") + 1  # and its end token


def test_qwen_text_turns_speak_and_turn_two_prefills_only_itself(rt_server):
    async def turn(conn, text):
        await _say(conn, text)
        before = node_stat(rt_server, "qwen3-omni", "thinker", "tokens_forwarded")
        await conn.response.create(response={"max_output_tokens": 4})
        seen: list = []
        done = await until(conn, "response.done", seen)
        after = node_stat(rt_server, "qwen3-omni", "thinker", "tokens_forwarded")
        return done.response, seen, after - before

    async def go():
        async with client(rt_server).realtime.connect(model="qwen3-omni") as conn:
            session = await _open(conn, audio={"input": {"turn_detection": None}})
            assert session.output_modalities == ["audio"] and session.audio.output.voice
            return await turn(conn, "Hello there, how are you today?"), await turn(conn, "And tomorrow?")

    (r1, seen1, fwd1), (r2, _, fwd2) = asyncio.run(go())
    audio = b"".join(base64.b64decode(e.delta) for e in seen1 if e.type == "response.output_audio.delta")
    assert len(audio) > 0 and len(audio) % 2 == 0  # pcm16 at 24 kHz
    transcript = "".join(e.delta for e in seen1 if e.type == "response.output_audio_transcript.delta")
    assert transcript == next(e.transcript for e in seen1 if e.type == "response.output_audio_transcript.done")
    assert r1.output[0].content[0].type == "output_audio"
    for r in (r1, r2):
        assert r.status in ("completed", "incomplete")
    # the thinker's rows: the prompt's (less any cached pages), then one per reply token fed back (not the last)
    fed1, fed2 = r1.usage.output_token_details.text_tokens - 1, r2.usage.output_token_details.text_tokens - 1
    assert fwd1 == r1.usage.input_tokens + fed1  # a fresh conversation: nothing cached
    cached_len = r1.usage.input_tokens + fed1  # what turn 1 left in the KV cache
    new_tokens = r2.usage.input_tokens - cached_len
    prefill2 = fwd2 - fed2
    assert new_tokens > 0
    # turn 2 computes only its new tokens: turn 1's last, partly written page is reused, not recomputed
    assert prefill2 == new_tokens


def test_qwen_audio_turn(rt_server):
    async def go():
        async with client(rt_server).realtime.connect(model="qwen3-omni") as conn:
            await _open(conn, output_modalities=["text"], audio={"input": {"turn_detection": None}})
            speech = tone(1.0)
            for piece in range(0, speech.size, 4800):  # 200 ms appends, as a microphone sends them
                await conn.input_audio_buffer.append(audio=b64(speech[piece:piece + 4800]))
            await conn.input_audio_buffer.commit()
            seen: list = []
            committed = await until(conn, "input_audio_buffer.committed", seen)
            added = await until(conn, "conversation.item.added", seen)
            await conn.response.create(response={"max_output_tokens": 3})
            done = await until(conn, "response.done", seen)
            return committed, added, done

    committed, added, done = asyncio.run(go())
    assert added.item.id == committed.item_id and added.item.content[0].type == "input_audio"
    assert done.response.status in ("completed", "incomplete")
    assert done.response.usage.input_tokens > 20  # the audio's placeholders are part of the prompt


def test_cancel_frees_the_request_and_the_session_goes_on(rt_server):
    async def go():
        async with client(rt_server).realtime.connect(model="toy-chat") as conn:
            await _open(conn, output_modalities=["text"], audio={"input": {"turn_detection": None}})
            await _say(conn, "x" * 400)  # 400 toy steps of 10 ms: far longer than the test waits
            await conn.response.create()
            seen: list = []
            await until(conn, "response.output_text.delta", seen)
            await conn.response.cancel()
            done = await until(conn, "response.done", seen)
            await asyncio.sleep(0.2)
            used = pages_used(rt_server, "toy-chat", "lm")
            await _say(conn, "again")
            await conn.response.create()
            again = await until(conn, "response.done")
            return done, seen, used, again

    done, seen, used, again = asyncio.run(go())
    assert done.response.status == "cancelled"
    assert done.response.status_details.reason == "client_cancelled"
    text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    assert 0 < len(text) < 400
    assert done.response.output[0].status == "incomplete"
    assert used == 0  # the cancelled request's pages are back
    assert again.response.status == "completed" and again.response.output[0].content[0].text == "again"


def test_server_vad_barge_in_cancels_at_once_and_truncates(rt_server):
    async def go():
        async with client(rt_server).realtime.connect(model="toy-tts") as conn:
            await _open(conn, audio={"input": {"turn_detection": {
                "type": "server_vad", "threshold": 0.5, "silence_duration_ms": 300, "prefix_padding_ms": 100,
                "create_response": False}}})
            await _say(conn, "a long sentence for the toy voice to read out " * 4)
            await conn.response.create()
            seen: list = []
            await until(conn, "response.output_audio.delta", seen)
            await conn.input_audio_buffer.append(audio=b64(silence(0.2)))
            await conn.input_audio_buffer.append(audio=b64(tone(0.3)))
            started = await until(conn, "input_audio_buffer.speech_started", seen)
            t0 = time.perf_counter()
            done = await until(conn, "response.done", seen)
            barge_ms = (time.perf_counter() - t0) * 1000
            truncated = next((e for e in seen if e.type == "conversation.item.truncated"), None)
            await asyncio.sleep(0.2)
            return started, done, barge_ms, truncated, seen, pages_used(rt_server, "toy-tts", "gen")

    started, done, barge_ms, truncated, seen, used = asyncio.run(go())
    assert started.audio_start_ms == pytest.approx(200, abs=40)  # where the tone began in the input stream
    assert done.response.status == "cancelled" and done.response.status_details.reason == "turn_detected"
    assert barge_ms < 500
    sent = sum(len(base64.b64decode(e.delta)) // 2 for e in seen if e.type == "response.output_audio.delta")
    assert truncated is not None and truncated.audio_end_ms <= sent * 1000 // 24000 + 1
    assert used == 0


def test_server_vad_commits_a_turn_and_answers(rt_server):
    async def go():
        async with client(rt_server).realtime.connect(model="qwen3-omni") as conn:
            await _open(conn, output_modalities=["text"], max_output_tokens=2, audio={"input": {"turn_detection": {
                "type": "server_vad", "silence_duration_ms": 400, "prefix_padding_ms": 200}}})
            audio = [silence(0.5), tone(0.8), silence(0.6)]
            for chunk in audio:
                await conn.input_audio_buffer.append(audio=b64(chunk))
            seen: list = []
            await until(conn, "response.done", seen)
            return seen

    seen = asyncio.run(go())
    order = types(seen)
    for kind in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                 "input_audio_buffer.committed", "conversation.item.added", "response.created", "response.done"):
        assert kind in order, (kind, order)
    stopped = next(e for e in seen if e.type == "input_audio_buffer.speech_stopped")
    started = next(e for e in seen if e.type == "input_audio_buffer.speech_started")
    assert started.audio_start_ms == pytest.approx(500, abs=40) and stopped.audio_end_ms == pytest.approx(1300, abs=40)
    assert order.index("input_audio_buffer.committed") < order.index("response.created")


def test_tool_call_round_trip(rt_server):
    call = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}
    tool = {"type": "function", "name": "get_weather", "description": "weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}

    async def go():
        async with client(rt_server).realtime.connect(model="toy-chat") as conn:
            session = await _open(conn, output_modalities=["text"], tools=[tool],
                                  audio={"input": {"turn_detection": None}})
            assert session.tools[0].name == "get_weather"
            # toy-chat echoes the user's text, so this is what a Qwen model writes when it calls the tool
            await _say(conn, f"Let me check.<tool_call>\n{json.dumps(call)}\n</tool_call>")
            await conn.response.create()
            first: list = []
            done1 = await until(conn, "response.done", first)
            fc = next(i for i in done1.response.output if i.type == "function_call")
            await conn.conversation.item.create(item={"type": "function_call_output", "call_id": fc.call_id,
                                                      "output": json.dumps({"temp": 21})})
            await until(conn, "conversation.item.done")
            await conn.response.create()
            second: list = []
            done2 = await until(conn, "response.done", second)
            return done1, first, fc, done2

    done1, first, fc, done2 = asyncio.run(go())
    assert fc.name == "get_weather" and json.loads(fc.arguments) == call["arguments"]
    deltas = [e.delta for e in first if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == fc.arguments  # streamed, then whole in .done
    args_done = next(e for e in first if e.type == "response.function_call_arguments.done")
    assert args_done.call_id == fc.call_id and args_done.arguments == fc.arguments
    message = done1.response.output[0]
    assert message.type == "message" and message.content[0].text == "Let me check."
    # the output went back as Qwen's tool response turn (toy-chat echoes it)
    reply = done2.response.output[0].content[0].text
    assert reply == '<tool_response>\n{"temp": 21}\n</tool_response>'


def test_llama_text_session_and_a_speaking_request_refused(rt_server):
    async def go():
        async with client(rt_server).realtime.connect(model="llama") as conn:
            created = await conn.recv()
            assert created.session.output_modalities == ["text"]  # llama does not speak
            await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"]})
            refused = await conn.recv()
            await _say(conn, "Hello there, how are you doing today?")
            await conn.response.create(response={"max_output_tokens": 6, "temperature": 0})
            first = await until(conn, "response.done")
            await _say(conn, "And again?")
            before = node_stat(rt_server, "llama", "lm", "tokens_forwarded")
            await conn.response.create(response={"max_output_tokens": 6, "temperature": 0})
            second = await until(conn, "response.done")
            rows = node_stat(rt_server, "llama", "lm", "tokens_forwarded") - before
            return refused, first, second, rows

    refused, first, second, rows = asyncio.run(go())
    assert refused.type == "error" and refused.error.param == "session.output_modalities"
    assert first.response.status in ("completed", "incomplete") and first.response.output[0].type == "message"
    # the second prompt holds the first turn and its reply, as the ids generated: only past the cache's last full
    # page is computed again (the reply's re-tokenized text could differ from its ids and miss the cache)
    u1, u2 = first.response.usage, second.response.usage
    cached = u1.input_tokens + u1.output_token_details.text_tokens - 1
    assert u2.input_tokens > cached
    assert rows - (u2.output_token_details.text_tokens - 1) == u2.input_tokens - cached  # (the partial page reused)


def test_a_chat_models_session_holds_tool_choice_by_grammar(rt_server):
    """A text chat model's session (llama, random weights) is held to the tools' grammar as the chat route is:
    `required` makes even random weights write a well-formed call, a named `tool_choice` calls that function."""
    weather = {"type": "function", "name": "get_weather", "description": "weather in a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                              "required": ["city"], "additionalProperties": False}}
    clock = {**weather, "name": "get_time", "description": "the time in a city"}

    async def go():
        async with client(rt_server).realtime.connect(model="llama") as conn:
            await _open(conn, output_modalities=["text"], tools=[weather, clock], tool_choice="required",
                        max_output_tokens=120, temperature=0)
            await _say(conn, "What is the weather in Paris?")
            await conn.response.create()
            required = await until(conn, "response.done")
            await _say(conn, "And the time there?")  # (a call waits for its output: a new question instead)
            await conn.response.create(response={"tool_choice": {"type": "function", "name": "get_time"}})
            named = await until(conn, "response.done")
            return required, named

    required, named = asyncio.run(asyncio.wait_for(go(), 120))
    for done, names in ((required, {"get_weather", "get_time"}), (named, {"get_time"})):
        assert done.response.status == "completed", done.response.status_details
        calls = [i for i in done.response.output if i.type == "function_call"]
        assert calls and {c.name for c in calls} <= names
        assert all(set(json.loads(c.arguments)) == {"city"} for c in calls)
    assert [c.name for c in named.response.output if c.type == "function_call"] == ["get_time"]
