"""The official `openai` client's realtime connection against `mstar serve --config examples/voice-agent.yaml`:
speech in (espeak-ng when installed), its transcript, the reply's text and audio out; a second turn that prefills
only its new tokens; barge-in cancelling the whole chain at once and truncating the reply at the audio sent;
preemptive generation: the reply starts at a pause in the user's speech, held (nothing of it reaches the client)
until the VAD's stop commits the same turn; speech that resumes drops it and frees its pages; the reply kept is the
reply a turn committed at the stop gets (greedy: the same transcript, words and audio)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path

import numpy as np
import pytest

from tests.realtime.helpers import b64, client, node_stat, types, until
from tests.voice_agent.speech import silence, speech

pytest.importorskip("openai")
pytest.importorskip("websockets")
pytest.importorskip("mstar_whisper")
pytest.importorskip("mstar_qwen_tts")

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "voice-agent.yaml"
RATE = 24_000
PARTS = (("llama", "lm"), ("qwen3-tts", "talker"), ("whisper", "decoder"))
VAD = {"type": "server_vad", "threshold": 0.5, "silence_duration_ms": 400, "prefix_padding_ms": 200,
       "create_response": True, "interrupt_response": True}


async def _open(conn, **session):
    assert (await conn.recv()).type == "session.created"
    await conn.session.update(session={"type": "realtime", **session})
    ev = await conn.recv()
    assert ev.type == "session.updated", ev
    return ev.session


async def _spoken_turn(conn, seen: list) -> object:
    for chunk in (silence(0.3), speech(), silence(0.8)):
        await conn.input_audio_buffer.append(audio=b64(chunk))
    return await until(conn, "response.done", seen)


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory):
    from tests.server.helpers import Server

    # the example as it ships, but every spoken piece runs to its frame bound: the tiny presets end a reply (1-2
    # tokens greedy) and its speech (~10 frames) by themselves within a second, sooner than a barge-in's speech can
    # reach the server's VAD
    # (seeded: the TTS samples its codes; a reply's audio is then the same each time it is spoken)
    text = CONFIG.read_text()
    assert "speech_options: {max_frames: 48}" in text
    config = tmp_path_factory.mktemp("voice-agent") / "voice-agent.yaml"
    config.write_text(text.replace("speech_options: {max_frames: 48}",
                                   "speech_options: {max_frames: 48, ignore_eos: true, seed: 0}"))
    srv = Server([], "--config", str(config), MSTAR_REALTIME_VAD="energy")

    async def warm_up():  # every node's first call (allocations, kernels) here, not in a test's time
        async with client(srv).realtime.connect(model="agent") as conn:
            await _open(conn, output_modalities=["audio"], max_output_tokens=8,
                        audio={"input": {"turn_detection": VAD}})
            await _spoken_turn(conn, [])

    asyncio.run(warm_up())
    yield srv
    assert srv.stop() == 0, srv.output()[-3000:]
    assert "Traceback" not in srv.serving_output(), srv.serving_output()[-3000:]


def test_a_spoken_turn_is_transcribed_answered_and_spoken(agent_server):
    async def go():
        async with client(agent_server).realtime.connect(model="agent") as conn:
            await _open(conn, output_modalities=["audio"], max_output_tokens=16,
                        audio={"input": {"turn_detection": VAD}})
            seen: list = []
            done = await _spoken_turn(conn, seen)
            return done, seen

    done, seen = asyncio.run(asyncio.wait_for(go(), 60))
    order = types(seen)
    for kind in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                 "input_audio_buffer.committed", "response.created",
                 "conversation.item.input_audio_transcription.completed", "response.output_audio.delta",
                 "response.output_audio_transcript.delta", "response.done"):
        assert kind in order, (kind, order)
    assert order.index("conversation.item.input_audio_transcription.completed") < \
        order.index("response.output_audio_transcript.delta")
    transcribed = next(e for e in seen if e.type == "conversation.item.input_audio_transcription.completed")
    committed = next(e for e in seen if e.type == "input_audio_buffer.committed")
    assert transcribed.item_id == committed.item_id and isinstance(transcribed.transcript, str)
    assert done.response.status in ("completed", "incomplete") and done.response.usage.input_tokens > 0
    assert sum(len(base64.b64decode(e.delta)) for e in seen if e.type == "response.output_audio.delta") > 0
    reply = "".join(e.delta for e in seen if e.type == "response.output_audio_transcript.delta")
    assert done.response.output[0].content[0].transcript == reply


def test_a_second_turn_prefills_only_its_new_tokens(agent_server):
    async def go():
        async with client(agent_server).realtime.connect(model="agent") as conn:
            await _open(conn, output_modalities=["text"], max_output_tokens=24, audio={"input": {"turn_detection": None}})
            dones, forwarded = [], []
            for text in ("Tell me about the sea.", "And tomorrow?"):
                before = node_stat(agent_server, "llama", "lm", "tokens_forwarded")
                await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": text}]})
                await until(conn, "conversation.item.done")
                await conn.response.create()
                dones.append((await until(conn, "response.done")).response)
                forwarded.append(node_stat(agent_server, "llama", "lm", "tokens_forwarded") - before)
            return dones, forwarded

    (first, second), (_, forwarded) = asyncio.run(asyncio.wait_for(go(), 60))
    assert first.status in ("completed", "incomplete") and second.status in ("completed", "incomplete")
    reply = len(first.output[0].content[0].text) and first.usage.output_tokens
    new_prompt = second.usage.input_tokens - first.usage.input_tokens - reply
    prefilled = forwarded - (second.usage.output_tokens - 1)
    # only the new user turn (and the template's joins, at most a partly filled page) is computed again
    assert 0 < prefilled <= new_prompt + 2 + 16, (prefilled, new_prompt, forwarded)
    assert prefilled < second.usage.input_tokens // 2


def test_barge_in_cancels_every_part_at_once_and_truncates_at_the_audio_sent(agent_server):
    async def attempt(conn):
        """One reply, spoken over as soon as its audio starts: (response.done, barge-in ms, events)."""
        await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Tell me a long story."}]})
        await until(conn, "conversation.item.done")
        await conn.response.create()
        seen: list = []
        t0 = None
        async for ev in conn:
            seen.append(ev)
            assert ev.type != "error", ev.error
            if ev.type == "response.output_audio.delta" and types(seen).count("response.output_audio.delta") == 1:
                await conn.input_audio_buffer.append(audio=b64(speech("Wait, stop.")))
            elif ev.type == "input_audio_buffer.speech_started":
                t0 = time.perf_counter()
            elif ev.type == "response.done":
                return ev, None if t0 is None else (time.perf_counter() - t0) * 1000, seen

    async def go():
        async with client(agent_server).realtime.connect(model="agent") as conn:
            await _open(conn, output_modalities=["audio"], max_output_tokens=400,
                        audio={"input": {"turn_detection": {**VAD, "create_response": False}}})
            for _ in range(3):  # random weights: a reply may end (EOS) before the user's speech reaches the server
                done, barge_ms, seen = await attempt(conn)
                if done.response.status == "cancelled":
                    break
                await conn.input_audio_buffer.clear()
                await until(conn, "input_audio_buffer.cleared")
        await asyncio.sleep(0.3)
        pages = {(m, n): node_stat(agent_server, m, n, "kv_pages_used")
                 for m, n in (("llama", "lm"), ("qwen3-tts", "talker"), ("whisper", "decoder"))}
        return done, barge_ms, seen, pages

    done, barge_ms, seen, pages = asyncio.run(asyncio.wait_for(go(), 90))
    assert "response.output_audio.delta" in types(seen)  # (the reply spoke before it was cut)
    assert done.response.status == "cancelled" and done.response.status_details.reason == "turn_detected", \
        [t for t in types(seen) if "delta" not in t]
    assert barge_ms is not None and barge_ms < 1000, barge_ms
    sent = sum(len(base64.b64decode(e.delta)) // 2 for e in seen if e.type == "response.output_audio.delta")
    truncated = next((e for e in seen if e.type == "conversation.item.truncated"), None)
    assert truncated is not None and truncated.audio_end_ms <= sent * 1000 // 24000 + 1
    assert all(v == 0 for v in pages.values()), pages  # every part's pages are back


async def _quiet(conn, seconds: float) -> list:
    """Events that arrive within `seconds`."""
    seen: list = []
    try:
        async with asyncio.timeout(seconds):
            async for ev in conn:
                seen.append(ev)
    except TimeoutError:
        pass
    return seen


def _trimmed(pcm: np.ndarray) -> np.ndarray:
    """`pcm` without the quiet espeak-ng ends a phrase with (a test's pause is the silence it sends)."""
    return pcm[: int(np.flatnonzero(np.abs(pcm) > 300)[-1]) + 1]


def test_speech_that_resumes_drops_the_held_reply_and_frees_its_pages(agent_server):
    first, second = _trimmed(speech("Hello there.")), speech("What is the weather like today?")

    async def go():
        async with client(agent_server).realtime.connect(model="agent") as conn:
            await _open(conn, output_modalities=["audio"], max_output_tokens=400, temperature=0,
                        audio={"input": {"turn_detection": VAD}})
            heard = node_stat(agent_server, "whisper", "decoder", "tokens_forwarded")
            # speech, then a pause longer than the preemptive 100 ms and shorter than the VAD's 400 ms stop
            await conn.input_audio_buffer.append(audio=b64(np.concatenate([silence(0.3), first, silence(0.25)])))
            held_pages, deadline = 0.0, time.monotonic() + 5
            while held_pages == 0 and time.monotonic() < deadline:  # the held reply holds the chat model's pages
                await asyncio.sleep(0.02)
                held_pages = node_stat(agent_server, "llama", "lm", "kv_pages_used")
            during = await _quiet(conn, 0.3)
            transcribed = node_stat(agent_server, "whisper", "decoder", "tokens_forwarded") - heard
            await conn.input_audio_buffer.append(audio=b64(second[: RATE // 2]))  # the user speaks on
            await asyncio.sleep(0.3)
            pages = {p: node_stat(agent_server, *p, "kv_pages_used") for p in PARTS}
            await conn.input_audio_buffer.append(audio=b64(np.concatenate([second[RATE // 2:], silence(0.8)])))
            seen: list = []
            await until(conn, "response.created", seen)
            await conn.response.cancel()  # (a 400-token reply spoken to its frame bounds: not waited for)
            done = await until(conn, "response.done", seen)
            await asyncio.sleep(0.3)
            return held_pages, during, transcribed, pages, done, seen

    held_pages, during, transcribed, pages, done, seen = asyncio.run(asyncio.wait_for(go(), 90))
    assert held_pages > 0 and transcribed > 0  # the reply to the first words ran: the ASR and the chat model
    assert types(during) in ([], ["input_audio_buffer.speech_started"]), types(during)  # ... unseen
    assert all(v == 0 for v in pages.values()), pages  # dropped when the speech resumed: every part's pages back
    order = types(during) + types(seen)
    assert order.count("input_audio_buffer.speech_stopped") == 1 and order.count("response.created") == 1, order
    stopped = next(e for e in seen if e.type == "input_audio_buffer.speech_stopped")
    assert stopped.audio_end_ms > 300 + 1000 * (first.size + RATE // 4) // RATE  # the one turn holds both parts
    assert done.response.status in ("completed", "incomplete", "cancelled")


def _pcm_stream() -> np.ndarray:
    return np.concatenate([silence(0.3), speech(), silence(0.8)])


def test_the_reply_started_at_the_pause_is_the_reply_to_the_turn_committed_at_the_stop(agent_server):
    stream = _pcm_stream()
    session = {"output_modalities": ["audio"], "max_output_tokens": 12, "temperature": 0}

    async def answer(conn) -> tuple[str, str, bytes, str]:
        seen: list = []
        done = await until(conn, "response.done", seen)
        assert done.response.status in ("completed", "incomplete"), done.response.status_details
        transcript = next(e.transcript for e in seen
                          if e.type == "conversation.item.input_audio_transcription.completed")
        reply = "".join(e.delta for e in seen if e.type == "response.output_audio_transcript.delta")
        audio = b"".join(base64.b64decode(e.delta) for e in seen if e.type == "response.output_audio.delta")
        return transcript, reply, audio, types(seen)

    async def go():
        async with client(agent_server).realtime.connect(model="agent") as conn:  # server VAD: preemptive
            await _open(conn, **session, audio={"input": {"turn_detection": VAD}})
            await conn.input_audio_buffer.append(audio=b64(stream))
            started = await until(conn, "input_audio_buffer.speech_started")
            stopped = await until(conn, "input_audio_buffer.speech_stopped")
            preemptive = await answer(conn)
        # the same samples the VAD committed, committed by hand: the reply starts at the commit
        turn = stream[(started.audio_start_ms - VAD["prefix_padding_ms"]) * RATE // 1000:
                      stopped.audio_end_ms * RATE // 1000]
        async with client(agent_server).realtime.connect(model="agent") as conn:
            await _open(conn, **session, audio={"input": {"turn_detection": None}})
            await conn.input_audio_buffer.append(audio=b64(turn))
            await conn.input_audio_buffer.commit()
            await until(conn, "conversation.item.done")
            await conn.response.create()
            at_commit = await answer(conn)
        return preemptive, at_commit

    preemptive, at_commit = asyncio.run(asyncio.wait_for(go(), 90))
    assert preemptive[0] == at_commit[0]  # the transcript
    assert preemptive[1] == at_commit[1] and preemptive[2] == at_commit[2]  # the reply's words and its audio
    assert len(preemptive[2]) > 0
    # the held reply went out after the turn's commit, in the order a reply started at the stop has
    order = preemptive[3]
    assert order.index("response.created") < order.index("conversation.item.input_audio_transcription.completed") \
        < order.index("response.output_audio.delta")


def test_a_held_reply_is_not_seen_before_the_stop(agent_server):
    """Streamed in real time: the stop comes 400 ms into the silence; nothing of the reply arrives before it."""

    async def go():
        async with client(agent_server).realtime.connect(model="agent") as conn:
            await _open(conn, output_modalities=["audio"], max_output_tokens=8, audio={"input": {"turn_detection": VAD}})
            await conn.input_audio_buffer.append(audio=b64(np.concatenate([silence(0.3), speech()])))
            step = RATE // 50
            pcm = silence(0.8)
            seen: list = []

            async def read():
                async for ev in conn:
                    seen.append((time.perf_counter(), ev))
                    if ev.type == "response.done":
                        return

            reader = asyncio.ensure_future(read())
            for at in range(0, pcm.size, step):
                await conn.input_audio_buffer.append(audio=b64(pcm[at:at + step]))
                await asyncio.sleep(0.02)
            await asyncio.wait_for(reader, 60)
            return seen

    seen = asyncio.run(asyncio.wait_for(go(), 90))
    kinds = [ev.type for _, ev in seen]
    stop = kinds.index("input_audio_buffer.speech_stopped")
    assert all(not k.startswith("response.") for k in kinds[:stop]), kinds[:stop]
    assert kinds.index("input_audio_buffer.committed") < kinds.index("response.created")
    assert "response.output_audio.delta" in kinds


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                          "required": ["city"], "additionalProperties": False}}


def test_a_tool_call_round_trip_the_agent_calls_then_speaks_the_answer(agent_server):
    """`tool_choice: required`: the chat model's reply is held to the tools' grammar, so even random weights write a
    call; it comes out as a function-call item (not spoken); the client's output for it and `response.create` get a
    spoken reply whose prompt holds the call and its result."""

    async def go():
        async with client(agent_server).realtime.connect(model="agent") as conn:
            await _open(conn, output_modalities=["audio"], max_output_tokens=200, temperature=0, tools=[WEATHER],
                        tool_choice="required", audio={"input": {"turn_detection": VAD}})
            called: list = []
            await conn.input_audio_buffer.append(audio=b64(np.concatenate([silence(0.3), speech(), silence(0.8)])))
            first = await until(conn, "response.done", called)
            call = next(i for i in first.response.output if i.type == "function_call")
            await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call.call_id,
                                                      "output": json.dumps({"sky": "clear", "celsius": 21})})
            await until(conn, "conversation.item.done")
            await conn.response.create(response={"tool_choice": "auto", "max_output_tokens": 12})
            answered: list = []
            second = await until(conn, "response.done", answered)
            return first, called, second, answered

    first, called, second, answered = asyncio.run(asyncio.wait_for(go(), 120))
    assert first.response.status == "completed", first.response.status_details
    call = next(i for i in first.response.output if i.type == "function_call")
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    kinds = types(called)
    assert "response.function_call_arguments.done" in kinds
    assert "response.output_audio.delta" not in kinds  # the call is an item, never spoken
    assert second.response.status in ("completed", "incomplete"), second.response.status_details
    assert "response.output_audio.delta" in types(answered)
    # the second prompt is the first's, the call and its result: more than the call's arguments longer
    assert second.response.usage.input_tokens > first.response.usage.input_tokens + len(call.arguments) // 4


TIME = {"type": "function", "name": "get_time", "description": "The time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                       "required": ["city"], "additionalProperties": False}}


def test_a_named_tool_choice_makes_the_agent_call_that_function(agent_server):
    """`tool_choice: {type: function, name}` (OpenAI's realtime form) holds the reply to that one function of the
    two offered; a name the tools lack is an error event naming `response.tool_choice.name`."""

    async def go():
        async with client(agent_server).realtime.connect(model="agent") as conn:
            await _open(conn, output_modalities=["audio"], max_output_tokens=200, temperature=0, tools=[WEATHER, TIME],
                        tool_choice={"type": "function", "name": "get_time"}, audio={"input": {"turn_detection": VAD}})
            await conn.input_audio_buffer.append(audio=b64(np.concatenate([silence(0.3), speech(), silence(0.8)])))
            first = await until(conn, "response.done")
            await conn.response.create(response={"tool_choice": {"type": "function", "name": "get_date"}})
            refused = await until(conn, "error")
            return first, refused

    first, refused = asyncio.run(asyncio.wait_for(go(), 120))
    calls = [i for i in first.response.output if i.type == "function_call"]
    assert [c.name for c in calls] == ["get_time"] and set(json.loads(calls[0].arguments)) == {"city"}
    assert refused.error.param == "response.tool_choice.name" and "get_date" in refused.error.message
