"""Chat with images and audio in, and spoken replies out, against a real `mstar serve` of the fixture chat models
(`mstar_fixture_plugin.chat_models`): the official `openai` client for what works, httpx for every 4xx.

The fixture talker speaks each reply byte b_k as 160 samples of 0.5 * b_k / 255 * sin(2 pi f n / 16000), n counting
from the reply's start, so every sample of the WAV the server returns can be predicted here.
"""

from __future__ import annotations

import base64
import http.server
import io
import re
import struct
import threading
import time

import httpx
import numpy as np
import pytest
import soundfile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import OpenAI
from PIL import Image

from mstar_core.api.media import MediaLimits, resample, url_allowed
from tests.server.helpers import Server, metric

RATE, PER_TOKEN = 16000, 160
PITCH = {"alto": 440.0, "bass": 110.0}


def expected_pcm(text: str, voice: str) -> np.ndarray:
    """The talker's speech for `text`, as the int16 samples a WAV of it must hold."""
    tokens = np.repeat(np.frombuffer(text.encode(), dtype=np.uint8).astype(np.float64), PER_TOKEN)
    n = np.arange(tokens.size)
    wave = 0.5 * tokens / 255.0 * np.sin(2 * np.pi * PITCH[voice] * n / RATE)
    return np.round(np.clip(wave, -1, 1) * 32767).astype(np.int16)


def assert_same_audio(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert np.abs(got.astype(np.int32) - want).max() <= 1  # float32 in the model, float64 here: one LSB at most


def png_uri(array: np.ndarray, fmt: str = "PNG", mime: str = "image/png") -> str:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt)
    return f"data:{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def wav_b64(samples: np.ndarray, rate: int = RATE, fmt: str = "WAV") -> str:
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt, **({"subtype": "PCM_16"} if fmt == "WAV" else {}))
    return base64.b64encode(buf.getvalue()).decode()


RNG = np.random.default_rng(7)
IMAGE = RNG.integers(0, 256, (24, 32, 3), dtype=np.uint8)
PCM = RNG.integers(-20000, 20000, 1600, dtype=np.int16)  # 0.1 s at 16 kHz


class _Images(http.server.BaseHTTPRequestHandler):
    """Serves the same PNG under /allowed/ and /secret/ (the server may fetch only the first)."""

    body = base64.b64decode(png_uri(IMAGE).split(",", 1)[1])

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def images_host():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def srv(images_host):
    server = Server(["fixture-talker", "fixture-narrator", "fixture-media", "toy-chat"],
                    MSTAR_MEDIA_URL_PREFIXES=f"{images_host}/allowed/", MSTAR_MEDIA_MAX_PARTS="4",
                    NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    yield server
    assert server.stop() == 0
    assert "Traceback" not in server.serving_output(), server.serving_output()[-3000:]


@pytest.fixture(scope="module")
def client(srv):
    return OpenAI(base_url=f"{srv.url}/v1", api_key=srv.api_key, max_retries=0, timeout=30)


def post(srv: Server, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers=srv.headers, timeout=30)


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


# --- spoken replies ------------------------------------------------------------------------------------------


def test_streamed_audio_deltas_and_transcript(srv, client):
    before = metric(srv, "mstar_time_to_first_audio_seconds_count", model="fixture-talker")
    stream = client.chat.completions.create(
        model="fixture-talker", messages=[{"role": "user", "content": "hello there"}],
        modalities=["text", "audio"], audio={"voice": "alto", "format": "wav"}, stream=True)
    events, ids, finish = [], set(), None
    for chunk in stream:
        choice = chunk.choices[0]
        assert choice.delta.content is None  # a spoken reply's text is its transcript
        audio = choice.delta.audio
        if audio is not None:
            ids.add(audio.id)
            if audio.transcript is not None:
                events.append(("text", audio.transcript))
            if audio.data is not None:
                events.append(("data", base64.b64decode(audio.data)))
            if audio.expires_at is not None:
                events.append(("end", audio.expires_at))
        finish = choice.finish_reason or finish
    assert finish == "stop" and len(ids) == 1
    kinds = [k for k, _ in events]
    assert kinds[-1] == "end" and kinds.count("end") == 1
    assert "".join(v for k, v in events if k == "text") == "hello there"
    data = [v for k, v in events if k == "data"]
    assert len(data) >= 5  # streamed as produced, not in one piece at the end
    assert kinds.index("data") < len(kinds) - 1 - kinds[::-1].index("text")  # audio before the text is over
    wav = b"".join(data)
    riff, _, wave, _, _, channels, rate, _, _, bits, tag, size = _wav_fields(wav)
    assert (riff, wave, tag, channels, rate, bits) == (b"RIFF", b"WAVE", b"data", 1, RATE, 16)
    assert size == 0xFFFFFFFF  # a streamed WAV's length is open-ended
    assert_same_audio(np.frombuffer(wav[44:], dtype="<i2"), expected_pcm("hello there", "alto"))
    assert metric(srv, "mstar_time_to_first_audio_seconds_count", model="fixture-talker") == before + 1


def _wav_fields(wav: bytes) -> tuple:
    riff, riff_size, wave, fmt_tag, fmt_size, pcm, channels, rate, byte_rate, block, bits, tag, size = struct.unpack(
        "<4sI4s4sIHHIIHH4sI", wav[:44])
    return riff, riff_size, wave, fmt_tag, fmt_size, channels, rate, byte_rate, block, bits, tag, size


def test_message_audio_is_a_wav_of_the_reply(client):
    reply = client.chat.completions.create(
        model="fixture-talker", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi!"}],
        modalities=["text", "audio"], audio={"voice": "bass", "format": "wav"})
    message = reply.choices[0].message
    assert message.content is None and message.audio.transcript == "Hi!"
    assert message.audio.id.startswith("audio_") and message.audio.expires_at == reply.created
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(message.audio.data)), dtype="int16")
    assert rate == RATE
    assert_same_audio(samples, expected_pcm("Hi!", "bass"))
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == 4  # three bytes and the end of the reply


@pytest.mark.parametrize("fmt", ["pcm16", "flac"])
def test_other_formats(srv, fmt):
    r = post(srv, {"model": "fixture-talker", "messages": [{"role": "user", "content": "abc"}],
                   "modalities": ["text", "audio"], "audio": {"voice": {"id": "alto"}, "format": fmt}})
    assert r.status_code == 200, r.text
    raw = base64.b64decode(r.json()["choices"][0]["message"]["audio"]["data"])
    got = np.frombuffer(raw, "<i2") if fmt == "pcm16" else soundfile.read(io.BytesIO(raw), dtype="int16")[0]
    assert_same_audio(got, expected_pcm("abc", "alto"))  # FLAC is lossless


def test_transcript_from_its_own_output(srv, client):
    stream = client.chat.completions.create(
        model="fixture-narrator", messages=[{"role": "user", "content": "quiet"}],
        modalities=["text", "audio"], audio={"voice": "alto", "format": "pcm16"}, stream=True,
        stream_options={"include_usage": True})
    pieces, data, usage = [], b"", None
    for chunk in stream:
        usage = chunk.usage or usage
        audio = chunk.choices[0].delta.audio if chunk.choices else None
        if audio is not None:
            pieces += [audio.transcript] if audio.transcript is not None else []
            data += base64.b64decode(audio.data) if audio.data else b""
    assert "".join(pieces) == "QUIET"  # the narrator's `spoken` output, not the tokens
    assert usage.completion_tokens == 6
    assert_same_audio(np.frombuffer(data, "<i2"), expected_pcm("quiet", "alto"))
    reply = post(srv, {"model": "fixture-narrator", "messages": [{"role": "user", "content": "ok"}],
                       "modalities": ["audio"], "audio": {"voice": "alto", "format": "wav"}}).json()
    assert reply["choices"][0]["message"]["audio"]["transcript"] == "OK"


def test_hanging_up_mid_speech_cancels_the_request(srv):
    before = metric(srv, "mstar_node_invocations", model="fixture-talker", node="lm")
    body = {"model": "fixture-talker", "messages": [{"role": "user", "content": "la" * 500}], "max_tokens": 2000,
            "modalities": ["text", "audio"], "audio": {"voice": "alto", "format": "pcm16"}, "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body, headers=srv.headers, timeout=30) as r:
        for line in r.iter_lines():
            if '"data":' in line:
                break  # the first audio is out: hang up
    for _ in range(50):
        if metric(srv, "mstar_running_requests") == 0:
            break
        time.sleep(0.1)
    assert metric(srv, "mstar_running_requests") == 0
    steps = metric(srv, "mstar_node_invocations", model="fixture-talker", node="lm") - before
    print(f"lm steps before the hang-up took effect: {steps:.0f} of 1001")
    assert 0 < steps < 500, steps  # cancelled, not run to its 1001 tokens


def test_text_only_request_to_a_talker(client):
    reply = client.chat.completions.create(model="fixture-talker", messages=[{"role": "user", "content": "plain"}])
    assert reply.choices[0].message.content == "plain" and reply.choices[0].message.audio is None


AUDIO_ERRORS = [
    ({"model": "toy-chat", "modalities": ["text", "audio"], "audio": {"voice": "alto", "format": "wav"}},
     400, "modalities", "does not produce audio"),
    ({"modalities": ["text", "audio"]}, 400, "audio", "'audio' is required"),
    ({"audio": {"voice": "alto", "format": "wav"}}, 400, "audio", "does not include"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "tenor", "format": "wav"}}, 400, "audio.voice", "alto, bass"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "alto", "format": "ogg"}}, 400, "audio.format", "pcm16"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "alto", "format": "ogg"}}, 400, "audio.format", ""),
    ({"modalities": ["text", "audio"], "audio": {"voice": "alto"}}, 400, "audio.format", "required"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "alto", "format": "flac"}, "stream": True},
     400, "audio.format", "cannot be streamed"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "alto", "format": "wav"}, "n": 2}, 400, "n", "one choice"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "alto", "format": "wav"}, "stop": "x"}, 400, "stop", "stop"),
    ({"modalities": ["video"]}, 400, "modalities.0", ""),
]


@pytest.mark.parametrize(("extra", "status", "param", "words"), AUDIO_ERRORS)
def test_audio_request_errors(srv, extra, status, param, words):
    r = post(srv, {"model": "fixture-talker", "messages": [{"role": "user", "content": "hi"}], **extra})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"]


# --- images and audio in -------------------------------------------------------------------------------------


def test_image_and_audio_parts_reach_the_model_in_order(client):
    stereo = np.stack([PCM, PCM // 3], axis=1)
    reply = client.chat.completions.create(model="fixture-media", messages=[
        {"role": "system", "content": "describe"},
        {"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": png_uri(IMAGE), "detail": "low"}},
            {"type": "input_audio", "input_audio": {"data": wav_b64(PCM), "format": "wav"}},
            {"type": "input_audio", "input_audio": {"data": wav_b64(stereo, rate=8000), "format": "wav"}},
            {"type": "text", "text": "ok?"},
        ]}])
    mono = (PCM.astype(np.float32) / 32768 + (PCM // 3).astype(np.float32) / 32768) / 2
    assert reply.choices[0].message.content == (
        f"text(8) text(4) image(24x32x3 sum={int(IMAGE.astype(np.int64).sum())}) "
        f"audio(1600@16000 sum={int(PCM.astype(np.int64).sum())}) "
        f"audio(1600@8000 sum={round(float(mono.astype(np.float64).sum()) * 32768)}) text(3)")


def test_jpeg_webp_and_mp3(client):
    jpeg = png_uri(IMAGE, "JPEG", "image/jpeg")
    decoded = np.asarray(Image.open(io.BytesIO(base64.b64decode(jpeg.split(",", 1)[1]))).convert("RGB"))
    buf = io.BytesIO()
    soundfile.write(buf, (PCM / 32768).astype(np.float32), RATE, format="MP3")
    reply = client.chat.completions.create(model="fixture-media", messages=user(
        {"type": "image_url", "image_url": {"url": jpeg}},
        {"type": "image_url", "image_url": {"url": png_uri(IMAGE, "WEBP", "image/webp")}},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(), "format": "mp3"}}))
    items = re.findall(r"\w+\([^)]*\)", reply.choices[0].message.content)
    assert items[0] == f"image(24x32x3 sum={int(decoded.astype(np.int64).sum())})"
    assert items[1].startswith("image(24x32x3 ") and items[2].startswith("audio(") and "@16000" in items[2]
    assert abs(int(items[2][6:].split("@")[0]) - 1600) <= 1152  # MP3 frames pad the end


def test_allowed_remote_image_is_fetched(srv, images_host):
    r = post(srv, {"model": "fixture-media", "messages": user(
        {"type": "image_url", "image_url": {"url": f"{images_host}/allowed/cat.png"}})})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == f"image(24x32x3 sum={int(IMAGE.astype(np.int64).sum())})"


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def audio(data: str, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


BIG = RNG.integers(0, 256, (100, 100, 3), dtype=np.uint8)
F = "messages[1].content[1]"


def media_errors(host: str) -> list[tuple]:
    """(model, second message's parts, status, param, words in the message)."""
    bmp = png_uri(IMAGE, "BMP", "image/png")
    return [
        ("toy-chat", [image(png_uri(IMAGE))], 400, f"{F}.image_url", "does not accept image input"),
        ("fixture-talker", [audio(wav_b64(PCM))], 400, f"{F}.input_audio", "does not accept audio input"),
        ("fixture-media", [image(f"{host}/secret/cat.png")], 400, f"{F}.image_url", "does not fetch"),
        ("fixture-media", [image(f"{host}/allowed/../secret/cat.png")], 400, f"{F}.image_url", "does not fetch"),
        ("fixture-media", [image("https://example.com/cat.png")], 400, f"{F}.image_url", "data URI"),
        ("fixture-media", [image("file:///etc/passwd")], 400, f"{F}.image_url", "data URI"),
        ("fixture-media", [image("data:image/png;base64,!!!")], 400, f"{F}.image_url", "not valid base64"),
        ("fixture-media", [image("data:image/png;base64," + base64.b64encode(b"junk" * 9).decode())], 400,
         f"{F}.image_url", "could not be decoded"),
        ("fixture-media", [image("data:image/png," + "abc")], 400, f"{F}.image_url", "base64"),
        ("fixture-media", [image("data:text/plain;base64,aGk=")], 400, f"{F}.image_url", "image/"),
        ("fixture-media", [image("data:image/svg+xml;base64,aGk=")], 400, f"{F}.image_url", "PNG, JPEG"),
        ("fixture-media", [image(bmp)], 400, f"{F}.image_url", "BMP"),
        ("fixture-media", [image(png_uri(BIG))], 413, f"{F}.image_url", "4096 pixels"),
        ("fixture-media", [image("data:image/png;base64," + "A" * 100_000)], 413, f"{F}.image_url", "65536 bytes"),
        ("fixture-media", [{"type": "image_url", "image_url": 5}], 400, f"{F}.image_url", "'url'"),
        ("fixture-media", [{"type": "image_url", "image_url": {"url": png_uri(IMAGE), "detail": "max"}}], 400,
         f"{F}.image_url", "detail"),
        ("fixture-media", [audio(wav_b64(PCM), "ogg")], 400, f"{F}.input_audio.format", "wav or mp3"),
        ("fixture-media", [audio(wav_b64(PCM), "mp3")], 400, f"{F}.input_audio", "holds WAV"),
        ("fixture-media", [audio(base64.b64encode(b"RIFF" + b"\0" * 40).decode())], 400, f"{F}.input_audio",
         "not decodable"),
        ("fixture-media", [audio("***")], 400, f"{F}.input_audio", "not valid base64"),
        ("fixture-media", [{"type": "input_audio", "input_audio": "abc"}], 400, f"{F}.input_audio", "data"),
        ("fixture-media", [audio(wav_b64(np.zeros(3 * RATE, np.int16)))], 413, f"{F}.input_audio", "2 s"),
        ("fixture-media", [{"type": "video_url", "video_url": {"url": "x"}}], 400, f"{F}.video_url",
         "does not accept video"),
        ("fixture-media", [{"type": "hologram", "hologram": {}}], 400, f"{F}.type", "not supported"),
        ("fixture-media", [image(png_uri(IMAGE))] * 5, 413, "messages", "at most 4"),
    ]


def test_media_errors_name_the_part(srv, images_host):
    for model, parts, status, param, words in media_errors(images_host):
        r = post(srv, {"model": model, "messages": [{"role": "system", "content": "x"},
                                                     {"role": "user", "content": [{"type": "text", "text": "a"}, *parts]}]})
        assert r.status_code == status, (param, r.text)
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], (param, error)


def test_stored_audio_references_are_refused(srv):
    r = post(srv, {"model": "fixture-media", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "audio": {"id": "audio_1"}},
        {"role": "user", "content": "again"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].audio"


# --- fuzz: whatever the parts hold, the answer is a 2xx or a 4xx, never a 5xx --------------------------------

_junk = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8)),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                     max_leaves=5)
_b64 = st.binary(max_size=96).map(lambda b: base64.b64encode(b).decode())
_urls = st.one_of(st.sampled_from([png_uri(IMAGE), "http://[bad", "https://x/../y", "data:", "data:image/png;base64,",
                                   "data:image/gif;base64,R0lGODlh", "data:;base64,aGk="]),
                  _b64.map(lambda b: "data:image/png;base64," + b), st.text(max_size=12), _junk)
_parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("image_url"),
                           "image_url": st.one_of(st.fixed_dictionaries({"url": _urls}, optional={"detail": _junk}),
                                                  _junk)}),
    st.fixed_dictionaries({"type": st.just("input_audio"),
                           "input_audio": st.one_of(st.fixed_dictionaries(
                               {"data": st.one_of(_b64, st.just(wav_b64(PCM[:16])), _junk),
                                "format": st.one_of(st.sampled_from(["wav", "mp3", "flac"]), _junk)}), _junk)}),
    st.fixed_dictionaries({"type": st.one_of(st.text(max_size=10), _junk)}, optional={"text": _junk}),
)
_audio = st.one_of(_junk, st.fixed_dictionaries({"voice": st.one_of(st.sampled_from(["alto", "x"]), _junk),
                                                 "format": st.one_of(st.sampled_from(["wav", "opus"]), _junk)}))


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(model=st.sampled_from(["fixture-media", "fixture-talker", "toy-chat"]),
       parts=st.lists(_parts, max_size=3), modalities=st.one_of(st.none(), st.just(["text", "audio"]), _junk),
       audio=st.one_of(st.none(), _audio), stream=st.booleans())
def test_parts_fuzz_never_5xx(srv, model, parts, modalities, audio, stream):
    body = {"model": model, "messages": [{"role": "user", "content": parts}], "max_tokens": 4, "stream": stream}
    body.update({k: v for k, v in (("modalities", modalities), ("audio", audio)) if v is not None})
    r = post(srv, body)
    assert r.status_code < 500, r.text
    if stream and r.status_code == 200:
        assert '"error"' not in r.text and r.text.rstrip().endswith("data: [DONE]")


# --- units ---------------------------------------------------------------------------------------------------


def test_url_allowed():
    prefixes = ["https://cdn.example.com/img/", "http://127.0.0.1:9000"]
    assert url_allowed("https://cdn.example.com/img/a.png", prefixes)
    assert url_allowed("HTTPS://CDN.example.com/img/x/y.png", prefixes)
    assert url_allowed("http://127.0.0.1:9000/anything", prefixes)
    assert not url_allowed("https://cdn.example.com/imgx/a.png", prefixes)
    assert not url_allowed("https://cdn.example.com/img/../secret.png", prefixes)
    assert not url_allowed("https://cdn.example.com/img/%2e%2e/secret.png", prefixes)
    assert not url_allowed("https://cdn.example.com.evil.net/img/a.png", prefixes)
    assert not url_allowed("https://user@cdn.example.com/img/a.png", prefixes)
    assert not url_allowed("http://127.0.0.1:90001/a", prefixes)


def test_limits_from_env():
    base = MediaLimits(max_image_pixels=10)
    got = base.with_env({"MSTAR_MEDIA_MAX_IMAGE_PIXELS": "20", "MSTAR_MEDIA_MAX_AUDIO_SECONDS": "1.5",
                         "MSTAR_MEDIA_URL_PREFIXES": "https://a/, https://b/"})
    assert (got.max_image_pixels, got.max_audio_seconds, got.url_prefixes) == (20, 1.5, ("https://a/", "https://b/"))
    assert base.with_env({}) is base


@pytest.mark.parametrize(("src", "dst"), [(44100, 16000), (8000, 16000), (24000, 16000)])
def test_resample_keeps_a_tone(src, dst):
    t = np.arange(src) / src
    got = resample(np.sin(2 * np.pi * 1000 * t).astype(np.float32), src, dst)
    assert got.size == dst
    want = np.sin(2 * np.pi * 1000 * np.arange(dst) / dst)
    assert np.abs(got - want)[200:-200].max() < 2e-3  # away from the edges, where the filter runs off the signal
    high = resample(np.sin(2 * np.pi * 15000 * t).astype(np.float32), src, dst) if src > 30000 else None
    if high is not None:  # above the new Nyquist: filtered out, not folded back as a 1 kHz alias
        assert np.abs(high[200:-200]).max() < 0.02


def test_typed_adapter_serves_plain_bodies_too():
    from mstar_fixture_plugin.chat_models import MediaAdapter, TalkerAdapter

    body = {"messages": [{"role": "developer", "content": "sys"}, {"role": "user", "content": "hey"}], "max_tokens": 3}
    assert MediaAdapter().chat_inputs(body) == {"items": [("text", "sys"), ("text", "hey")], "max_tokens": 3}
    assert TalkerAdapter().chat_inputs(body) == {"text": "hey", "max_tokens": 3, "voice": None}


def test_transcript_from_the_final_env_and_a_buffered_wav():
    from types import SimpleNamespace

    from mstar_core.api.requests.adapters import to_int16_pcm
    from mstar_core.api.requests.chat_audio import AudioReply

    adapter = SimpleNamespace(chat_audio_output="wave", chat_transcript_output="said", sample_rate=8000,
                              audio_chunk=to_int16_pcm)
    reply = AudioReply(adapter, "wav", stream=False)
    assert reply.feed(SimpleNamespace(name="wave", value=np.array([0.5, -0.5], np.float32))) == ""
    assert reply.feed(SimpleNamespace(name="next_token", value=3)) is None  # not the reply's: the text's
    assert reply.take() == b""  # a WAV with exact sizes needs the whole signal
    assert reply.finish({"said": ["he", "llo"]}) == "hello" and reply.transcript == "hello"
    samples, rate = soundfile.read(io.BytesIO(reply.take()), dtype="int16")
    assert rate == 8000 and samples.tolist() == [16384, -16384]


def test_image_decoding_details():
    from mstar_core.api.media import decode_image
    from mstar_core.errors import RequestError

    limits = MediaLimits()
    frames = [Image.fromarray(np.full((4, 4, 3), v, np.uint8)) for v in (0, 255)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    with pytest.raises(RequestError, match="animation"):
        decode_image(buf.getvalue(), "f", limits)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: the camera was turned; the pixels are stored sideways
    buf = io.BytesIO()
    Image.fromarray(IMAGE).save(buf, format="JPEG", exif=exif)
    assert decode_image(buf.getvalue(), "f", limits).size == (24, 32)  # upright: width and height swapped
    buf = io.BytesIO()
    Image.fromarray(IMAGE[..., 0]).save(buf, format="PNG")  # greyscale comes out RGB
    assert decode_image(buf.getvalue(), "f", limits).mode == "RGB"
    for orientation, upright in ((6, np.rot90(IMAGE, -1)), (3, IMAGE[::-1, ::-1])):  # turned in place: the same pixels
        exif[0x0112] = orientation
        buf = io.BytesIO()
        Image.fromarray(IMAGE).save(buf, format="PNG", exif=exif)
        np.testing.assert_array_equal(np.asarray(decode_image(buf.getvalue(), "f", limits)), upright)

