"""`/v1/audio/voices` and `WS /v1/audio/speech/stream` on `mstar serve qwen3-tts --preset tiny-base` (a Base
checkpoint: it clones voices). A created voice speaks through the official openai client, streamed and not; bad
uploads are 4xx naming the field; another API key can neither see nor use nor delete a voice; the stream route
speaks text as it arrives, segment by segment, and flushes and cancels."""

import base64
import io
import json

import httpx
import numpy as np
import pytest
import soundfile
from openai import OpenAI

from tests.server.helpers import Server


def _wav(seconds: float, rate: int = 24000, freq: float = 180.0) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    soundfile.write(buf, (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), rate, format="WAV",
                    subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture(scope="module")
def server(preset_cache):
    srv = Server(["qwen3-tts"], "--preset", "tiny-base", api_key=None, MSTAR_MAX_VOICES="2")
    yield srv
    srv.stop()


def _headers(key):
    return {"Authorization": f"Bearer {key}"}


def _create(server, key, **fields):
    form = {"model": "qwen3-tts", "transcript": "Hello, this is my voice.", "consent": "true", **fields}
    files = {"file": ("me.wav", fields.pop("audio", None) or _wav(1.5), "audio/wav")}
    form.pop("audio", None)
    return httpx.post(f"{server.url}/v1/audio/voices", data=form, files=files, headers=_headers(key), timeout=60)


def test_a_created_voice_speaks_for_its_key_only(server):
    r = _create(server, "alice", name="alice-1")
    assert r.status_code == 200, r.text
    voice = r.json()
    assert voice["id"].startswith("voice_") and voice["name"] == "alice-1" and voice["model"] == "qwen3-tts"
    listed = httpx.get(f"{server.url}/v1/audio/voices", headers=_headers("alice"), timeout=30).json()["data"]
    assert [v["id"] for v in listed] == [voice["id"]]

    alice = OpenAI(base_url=f"{server.url}/v1", api_key="alice")
    wav = alice.audio.speech.create(model="qwen3-tts", voice=voice["id"], input="Hello there.", response_format="wav",
                                    extra_body={"seed": 1, "max_frames": 12}).read()
    samples, rate = soundfile.read(io.BytesIO(wav), dtype="int16")
    assert rate == 24000 and 0 < samples.size <= 12 * 1920
    with alice.audio.speech.with_streaming_response.create(model="qwen3-tts", voice=voice["id"], input="Hi.",
                                                           response_format="pcm",
                                                           extra_body={"seed": 1, "max_frames": 12}) as response:
        assert sum(len(p) for p in response.iter_bytes()) > 0

    # bob: the voice is invisible and unusable, and he cannot delete it
    assert httpx.get(f"{server.url}/v1/audio/voices", headers=_headers("bob"), timeout=30).json()["data"] == []
    r = httpx.post(f"{server.url}/v1/audio/speech", headers=_headers("bob"), timeout=30,
                   json={"model": "qwen3-tts", "voice": voice["id"], "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "voice"
    assert httpx.delete(f"{server.url}/v1/audio/voices/{voice['id']}", headers=_headers("bob"),
                        timeout=30).status_code == 404
    # a Base checkpoint speaks cloned voices only
    r = httpx.post(f"{server.url}/v1/audio/speech", headers=_headers("alice"), timeout=30,
                   json={"model": "qwen3-tts", "input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "voice"
    r = httpx.delete(f"{server.url}/v1/audio/voices/{voice['id']}", headers=_headers("alice"), timeout=30)
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert httpx.get(f"{server.url}/v1/audio/voices", headers=_headers("alice"), timeout=30).json()["data"] == []


@pytest.mark.parametrize("fields,status,param", [
    ({"audio": b"this is not audio at all"}, 400, "file"),
    ({"audio": _wav(31, rate=8000)}, 413, "file"),
    ({"consent": "no"}, 400, "consent"),
    ({"transcript": "  "}, 400, "transcript"),
    ({"audio": _wav(0.2)}, 400, "file"),
])
def test_bad_uploads_are_4xx_naming_the_field(server, fields, status, param):
    r = _create(server, "carol", **fields)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_voices_are_bounded_per_key(server):
    for _ in range(2):
        assert _create(server, "dave").status_code == 200
    r = _create(server, "dave")
    assert r.status_code == 409 and r.json()["error"]["param"] == "file"
    assert _create(server, "erin").status_code == 200  # another key's bound is its own


def test_stream_route_speaks_segments_as_text_arrives(server):
    from websockets.sync.client import connect

    voice = _create(server, "frank").json()["id"]
    url = server.url.replace("http", "ws") + "/v1/audio/speech/stream?model=qwen3-tts"
    with connect(url, additional_headers=_headers("frank")) as ws:
        ws.send(json.dumps({"type": "session.update", "session": {"voice": voice, "max_frames": 10, "seed": 3}}))
        ws.send(json.dumps({"type": "input_text.append", "text": "Hello there. How"}))
        events = _until(ws, "segment.done")
        assert events[0] == {"type": "segment.started", "segment": 0, "text": "Hello there."}
        audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "audio.delta")
        assert 0 < len(audio) <= 10 * 1920 * 2
        ws.send(json.dumps({"type": "input_text.append", "text": " are you"}))
        ws.send(json.dumps({"type": "input_text.flush"}))
        events = _until(ws, "flush.done")
        assert events[0] == {"type": "segment.started", "segment": 1, "text": "How are you"}
        assert [e["type"] for e in events][-2:] == ["segment.done", "flush.done"]
        ws.send(json.dumps({"type": "input_text.append", "text": "This will never be spoken"}))
        ws.send(json.dumps({"type": "cancel"}))
        ws.send(json.dumps({"type": "input_text.flush"}))
        assert [e["type"] for e in _until(ws, "flush.done")] == ["cancelled", "flush.done"]  # nothing left to speak
        ws.send(json.dumps({"type": "dance"}))
        assert _until(ws, "error")[-1]["error"]["param"] == "type"
    with connect(url, additional_headers=_headers("grace")) as ws:  # another key: the voice is not there
        ws.send(json.dumps({"type": "session.update", "session": {"voice": voice}}))
        err = _until(ws, "error")[-1]["error"]
        assert err["param"] == "session.voice" and err["code"] == "voice_not_found"


def _until(ws, kind, limit=200):
    events = []
    for _ in range(limit):
        events.append(json.loads(ws.recv(timeout=60)))
        if events[-1]["type"] == kind:
            return events
    raise AssertionError(f"no {kind} in {events}")
