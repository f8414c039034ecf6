"""Unit checks: the energy turn detector on synthetic speech and silence, Silero on silence, the tool-call
stream parser fed piece by piece, history bounds, and back-pressure on a client that stops reading."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

from mstar_core.api.realtime.conversation import Conversation, Item
from mstar_core.api.realtime.limits import RealtimeLimits
from mstar_core.api.realtime.protocol import ClientTooSlow, EventError, decode_pcm16
from mstar_core.api.realtime.vad import EnergyScorer, TurnDetector
from mstar_core.api.requests.tool_parser import ToolCallStream
from tests.realtime.helpers import silence, tone


def _events(detector, pcm, chunk=480):
    out = []
    for i in range(0, pcm.size, chunk):
        out += detector.feed(pcm[i:i + chunk])
    return [(e.kind, e.ms) for e in out]


def test_energy_detector_finds_each_utterance():
    d = TurnDetector(0.5, silence_duration_ms=300, prefix_padding_ms=100, scorer_factory=EnergyScorer)
    pcm = np.concatenate([silence(0.5), tone(0.6), silence(0.5), tone(0.4, amplitude=0.1), silence(0.6)])
    assert _events(d, pcm) == [("started", 500), ("stopped", 1100), ("started", 1600), ("stopped", 2000)]


def test_energy_detector_ignores_quiet_noise_clicks_and_a_steady_hum():
    d = TurnDetector(0.5, silence_duration_ms=300, scorer_factory=EnergyScorer)
    click = np.zeros(2400, dtype=np.int16)
    click[1000:1200] = 20000  # 8 ms: shorter than the 60 ms a start needs
    assert _events(d, np.concatenate([silence(1.0, noise=0.003), click, silence(0.5)])) == []
    hum = TurnDetector(0.5, silence_duration_ms=300, scorer_factory=EnergyScorer)
    t = np.arange(24000 * 6) / 24000
    steady = (0.05 * np.sin(2 * np.pi * 50 * t) * 32767).astype(np.int16)
    kinds = [k for k, _ in _events(hum, steady)]
    assert kinds[:2] == ["started", "stopped"]  # the floor rises through the hum: it does not stay speech


def test_threshold_sets_the_level():
    loud_only = TurnDetector(0.9, silence_duration_ms=300, scorer_factory=EnergyScorer)
    quiet = np.concatenate([silence(0.3), tone(0.5, amplitude=0.05), silence(0.5)])
    assert _events(loud_only, quiet) == []
    assert _events(TurnDetector(0.3, silence_duration_ms=300, scorer_factory=EnergyScorer), quiet)[0][0] == "started"


def test_silero_stays_quiet_on_silence():
    pytest.importorskip("silero_vad")
    from mstar_core.api.realtime.vad import SileroScorer, silero_model

    model = silero_model()
    if model is None:
        pytest.skip("silero-vad does not load here")
    d = TurnDetector(0.5, scorer_factory=lambda th: SileroScorer(th, model))
    assert _events(d, silence(1.0), chunk=768) == []


def test_tool_call_stream_piece_by_piece():
    call = {"name": "get_weather", "arguments": {"city": "Paris", "nested": {"a": [1, 2]}}}
    text = f"Sure.<tool_call>\n{json.dumps(call)}\n</tool_call>"
    stream = ToolCallStream()
    events = [e for ch in text for e in stream.feed(ch)] + stream.finish()
    assert "".join(e.text for e in events if e.kind == "text") == "Sure."
    assert [e.name for e in events if e.kind == "start"] == ["get_weather"]
    args = [e.text for e in events if e.kind == "arguments"]
    assert len(args) > 5 and json.loads("".join(args)) == call["arguments"]
    end = next(e for e in events if e.kind == "end")
    assert end.valid and end.text == "".join(args)


def test_tool_call_stream_other_key_order_and_unclosed():
    stream = ToolCallStream()
    events = stream.feed('<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>after') + stream.finish()
    assert [(e.kind, e.name) for e in events if e.kind in ("start", "end")] == [("start", "f"), ("end", "f")]
    assert events[-1].kind == "text" and events[-1].text == "after"
    stream = ToolCallStream()
    events = stream.feed('<tool_call>\n{"name": "g", "arguments": {"y": 2}}') + stream.finish()  # EOS, no close tag
    end = events[-1]
    assert end.kind == "end" and end.name == "g" and json.loads(end.text) == {"y": 2}
    assert ToolCallStream().feed("a < b <tool") == [next(iter(ToolCallStream().feed("a < b ")))]


def test_history_drops_the_oldest_items_and_calls_with_their_outputs():
    conv = Conversation(max_items=3)
    conv.add(Item("c1", "function_call", name="f", call_id="k"))
    conv.add(Item("o1", "function_call_output", call_id="k", output="1"))
    conv.add(Item("m1", "message", role="user", text="a"))
    conv.add(Item("m2", "message", role="user", text="b"))
    assert [i.id for i in conv.items] == ["m1", "m2"]
    audio = Conversation(max_audio_seconds=1.5)
    for n in range(3):
        audio.add(Item(f"a{n}", "message", role="user", audio=np.zeros(24000, dtype=np.int16)))
    assert [i.id for i in audio.items] == ["a2"]


def test_pcm16_decoding_refuses_bad_input():
    with pytest.raises(EventError) as err:
        decode_pcm16("!!", "audio", 100)
    assert err.value.code == "invalid_base64"
    with pytest.raises(EventError) as err:
        decode_pcm16("A" * 400, "audio", 100)
    assert err.value.code == "audio_too_large"


def test_a_client_that_stops_reading_is_dropped_not_buffered():
    from mstar_core.api.realtime.protocol import event
    from mstar_core.api.realtime.session import RealtimeSession

    class Bridge:
        model, speaks, voices, default_modalities, takes_audio = "m", False, (), ("text",), False

    async def never(_payload):
        await asyncio.Event().wait()  # a socket whose peer reads nothing

    async def go():
        limits = RealtimeLimits(send_queue=4, send_timeout=0.2)
        session = RealtimeSession(None, Bridge(), limits, never)
        sender = asyncio.ensure_future(session.sender())
        with pytest.raises(ClientTooSlow):
            for _ in range(100):
                await session.emit(event("x"))
        sender.cancel()
        return session

    session = asyncio.run(go())
    assert session.stopped.is_set() and session.queue.qsize() <= 4


def test_idle_and_lifetime_bounds_end_the_session_with_an_error_event():
    from mstar_core.api.realtime.session import RealtimeSession
    from mstar_core.api.routes import realtime as route

    class Bridge:
        model, speaks, voices, default_modalities, takes_audio = "m", False, (), ("text",), False

    class SilentSocket:
        def __init__(self):
            self.closed: list[int] = []

        async def receive(self):
            await asyncio.Event().wait()  # a client that sends nothing

        async def close(self, code=1000, reason=""):
            self.closed.append(code)

    async def go(limits):
        sent: list[dict] = []

        async def send(payload):
            sent.append(payload)

        session = RealtimeSession(None, Bridge(), limits, send)
        sender = asyncio.ensure_future(session.sender())
        ws = SilentSocket()
        started = time.monotonic()
        await asyncio.wait_for(route._receive_loop(ws, session, sender, limits), 5)
        sender.cancel()
        return sent, ws.closed, time.monotonic() - started

    sent, closed, took = asyncio.run(go(RealtimeLimits(idle_seconds=0.3)))
    assert sent[-1]["type"] == "error" and sent[-1]["error"]["code"] == "session_idle" and closed == [1000]
    assert 0.25 < took < 2
    sent, closed, _ = asyncio.run(go(RealtimeLimits(idle_seconds=60, max_session_seconds=0.3)))
    assert sent[-1]["error"]["code"] == "session_expired" and closed == [1000]


def test_tool_choice_names_one_function_or_is_refused_naming_the_field():
    from mstar_core.api.realtime.config import FunctionChoice, SessionConfig, response_options, update_session

    base = SessionConfig(model="m")
    weather = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    named = update_session(base, {"tools": [weather], "tool_choice": {"type": "function", "name": "get_weather"}},
                           speaks=True, voices=[], voice_locked=False)
    assert named.tool_choice == FunctionChoice("get_weather")
    assert named.to_json("s")["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert response_options(named, {"tool_choice": "auto"}, speaks=True, voices=[]).tool_choice == "auto"
    assert response_options(named, None, speaks=True, voices=[]).tool_choice == FunctionChoice("get_weather")
    bad = [({"type": "function"}, "session.tool_choice.name"), ({"type": "function", "name": ""}, "session.tool_choice.name"),
           ({"type": "function", "name": "f", "strict": True}, None), ({"type": "mcp"}, "session.tool_choice"),
           ("always", "session.tool_choice"), (3, "session.tool_choice")]
    for value, param in bad:
        with pytest.raises(EventError) as info:
            update_session(base, {"tool_choice": value}, speaks=True, voices=[], voice_locked=False)
        if param is not None:
            assert info.value.param == param, (value, info.value.param)
        else:
            assert "strict" in str(info.value), value
    for data, param in [({"tool_choice": {"type": "function", "name": "get_time"}}, "session.tool_choice.name"),
                        ({"tools": []}, "session.tool_choice.name")]:  # (dropping the tool it names)
        with pytest.raises(EventError) as info:
            update_session(named, data, speaks=True, voices=[], voice_locked=False)
        assert info.value.param == param
    with pytest.raises(EventError) as info:
        response_options(named, {"tool_choice": {"type": "function", "name": "x"}}, speaks=True, voices=[])
    assert info.value.param == "response.tool_choice.name"
