"""`mstar serve qwen3-tts` (tiny preset, no options): the official openai client gets speech for a preset speaker,
streamed and not, with a style hint; unknown voices and bad bodies are 4xx naming the field."""

import io

import httpx
import pytest
import soundfile
from openai import OpenAI

from tests.server.helpers import Server

SEED = 7


@pytest.fixture(scope="module")
def server(preset_cache):
    srv = Server(["qwen3-tts"], api_key=None)
    yield srv
    srv.stop()


def _client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="none")


def test_speech_for_a_preset_speaker_is_wav_at_24k(server):
    speech = _client(server).audio.speech.create(model="qwen3-tts", voice="Ryan", input="Hello there.",
                                                 response_format="wav", extra_body={"seed": SEED})
    samples, rate = soundfile.read(io.BytesIO(speech.read()), dtype="int16")
    # the preset caps a reply at 48 frames of 1,920 samples (the real rate); EOS may come earlier
    assert rate == 24000 and 0 < samples.size <= 48 * 1920


def test_streamed_speech_arrives_in_pieces_and_honours_instructions(server):
    client = _client(server)
    body = {"model": "qwen3-tts", "voice": "eric", "input": "Hello there, a longer sentence to speak.",
            "response_format": "pcm", "extra_body": {"seed": SEED, "do_sample": False, "subtalker_dosample": False}}
    with client.audio.speech.with_streaming_response.create(**body) as response:
        pieces = [piece for piece in response.iter_bytes() if piece]
    plain = b"".join(pieces)
    # greedy speech ends by itself (EOS) before the preset's cap of 48 frames, EOS's slot included: whole frames, s16le
    frame = 1920 * 2
    assert 0 < len(plain) < 47 * frame and len(plain) % frame == 0
    styled = client.audio.speech.create(**body, instructions="Speak slowly.").read()
    # the instruct turn reaches the Talker (a longer prompt: its speech may end later, never past the cap)
    assert 0 < len(styled) < 47 * frame and len(styled) % frame == 0 and styled != plain


def test_bad_voice_and_fields_are_4xx_naming_the_field(server):
    r = httpx.post(f"{server.url}/v1/audio/speech", json={"model": "qwen3-tts", "input": "hi", "voice": "alloy"},
                   timeout=30)
    assert r.status_code == 400 and "alloy" in r.text
    r = httpx.post(f"{server.url}/v1/audio/speech", timeout=30,
                   json={"model": "qwen3-tts", "input": "hi", "voice": "ryan", "language": "klingon"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "language"


def test_ignore_eos_speaks_exactly_max_frames(server):
    """A field the model declares is never dropped on the way: `ignore_eos` reaches the Talker through the route."""
    body = {"model": "qwen3-tts", "voice": "eric", "input": "Hi.", "response_format": "pcm",
            "extra_body": {"seed": SEED, "do_sample": False, "subtalker_dosample": False, "max_frames": 12}}
    client = _client(server)
    ended = client.audio.speech.create(**body).read()
    full = client.audio.speech.create(**{**body, "extra_body": {**body["extra_body"], "ignore_eos": True}}).read()
    # max_frames codes 0, the last one unspoken: 11 frames of 1,920 s16le samples
    assert len(full) == 11 * 1920 * 2 and len(ended) < len(full)
