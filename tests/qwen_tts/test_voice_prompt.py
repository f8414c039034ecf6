"""A voice created with its transcript keeps the reference audio's codes beside its x-vector (the in-context clone
prompt), counted in the caller's bytes; speech with it, or with an x-vector-only voice (no transcript), runs neither
the speaker encoder nor the tokenizer's encoder: both are spied on, in the serving process itself."""

import io
import time

import numpy as np
import pytest
import soundfile
import torch


def _wav(seconds: float, rate: int = 24000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    g = np.random.default_rng(3)
    audio = 0.3 * np.sin(2 * np.pi * 180 * t) + 0.05 * g.standard_normal(t.size)
    buf = io.BytesIO()
    soundfile.write(buf, audio.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture(scope="module")
def client(preset_cache):
    from fastapi.testclient import TestClient

    from mstar_core.api.server.app import ModelToServe, ServerConfig, create_app
    from mstar_core.model import LoadOptions
    from mstar_core.plugins import discover
    from mstar_core.runtime import AsyncEngine

    registry = discover()
    config = ServerConfig(models=[ModelToServe("qwen3-tts", LoadOptions(preset="tiny-base"))])
    with TestClient(create_app(config, lambda: AsyncEngine(registry))) as client:
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        yield client


def test_voice_with_transcript_keeps_its_codes_and_speech_runs_no_encoder(client):
    adapter = client.app.state.mstar.adapter("qwen3-tts", "speech")
    embeds = []
    speaker_embed = adapter.speaker_encoder.embed
    adapter.speaker_encoder.embed = lambda wav: embeds.append(1) or speaker_embed(wav)
    encoder = adapter.speech_encoder
    before = encoder.encodes
    audio = _wav(1.5)

    def create(**form):
        r = client.post("/v1/audio/voices", data={"model": "qwen3-tts", "consent": "true", **form},
                        files={"file": ("me.wav", audio, "audio/wav")})
        assert r.status_code == 200, r.text
        return r.json()

    with_text = create(transcript="Hi, this is me.")
    assert encoder.encodes == before + 1 and len(embeds) == 1
    plain = create()  # no transcript: the x-vector alone, and no codec encoder
    assert encoder.encodes == before + 1 and len(embeds) == 2
    assert with_text["transcript"] == "Hi, this is me." and plain["transcript"] is None
    frames = -(-int(1.5 * 24000) // 1920)
    # the codes (4 bytes each) and the transcript are counted beside the x-vector
    assert with_text["prompt_bytes"] - plain["prompt_bytes"] == (
        4 * 4 * frames + len("ref_codes") + len("ref_text") + len("Hi, this is me."))

    def speak(voice):
        r = client.post("/v1/audio/speech", json={"model": "qwen3-tts", "voice": voice["id"], "input": "Hello there!",
                                                  "response_format": "pcm", "do_sample": False,
                                                  "subtalker_dosample": False, "max_frames": 8})
        assert r.status_code == 200, r.text
        return r.content

    icl, x_vector = speak(with_text), speak(plain)
    assert encoder.encodes == before + 1 and len(embeds) == 2  # speech ran no encoder
    # whole frames, each reply ended by EOS (the v4 presets) or at max_frames; the codes reached the Talker
    frame = 1920 * 2
    assert all(0 < len(a) <= 7 * frame and len(a) % frame == 0 for a in (icl, x_vector)) and icl != x_vector

    # what the voice keeps are the codes of its reference audio
    store = client.app.state.mstar.voices
    kept = next(v for scope in store._voices.values() for v in scope.values() if v.id == with_text["id"])
    samples, _ = soundfile.read(io.BytesIO(audio), dtype="float32")
    assert kept.prompt["ref_codes"] == encoder.encode(torch.from_numpy(samples)).flatten().tolist()


def test_blank_transcript_and_bad_codes_are_4xx_naming_the_field(client):
    r = client.post("/v1/audio/voices", data={"model": "qwen3-tts", "consent": "true", "transcript": "  "},
                    files={"file": ("me.wav", _wav(1.0), "audio/wav")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "transcript"
    embedding = [0.0] * 64
    for extra, param in [({"ref_codes": [1, 2, 3, 4, 5], "ref_text": "hi"}, "ref_codes"),
                         ({"ref_codes": [1, 2, 3, 4096], "ref_text": "hi"}, "ref_codes"),
                         ({"ref_codes": [1, 2, 3, 4]}, "ref_text")]:
        r = client.post("/v1/walks/qwen3-tts", json={"inputs": {"input": "hi", "speaker_embedding": embedding,
                                                                "max_frames": 2, **extra}, "stream": False})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
