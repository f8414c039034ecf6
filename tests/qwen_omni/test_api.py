"""`mstar serve qwen3-omni` (tiny preset): the official openai client gets streamed audio deltas with a transcript
from chat, a WAV from /v1/audio/speech; unknown voices and bad bodies are 4xx naming the field."""

import base64
import io

import httpx
import pytest
import soundfile
from openai import OpenAI

from tests.server.helpers import Server

# The tiny preset's Talker samples noise codes (temperature 0.9) and may draw EOS first, a valid empty reply;
# a fixed seed keeps these tests about the routes, not about that draw.
SEED = 1234


@pytest.fixture(scope="module")
def server(preset_cache):
    srv = Server(["qwen3-omni"], api_key=None)
    yield srv
    srv.stop()


def test_chat_streams_audio_deltas_and_a_transcript(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
    stream = client.chat.completions.create(
        model="qwen3-omni", messages=[{"role": "user", "content": "Hello!"}], modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "wav"}, stream=True, max_tokens=4, temperature=0,
        extra_body={"seed": SEED})
    audio, transcript, pieces = b"", "", 0
    for chunk in stream:
        piece = chunk.choices[0].delta.audio if chunk.choices else None
        if piece is None:
            continue
        if piece.data is not None:
            audio += base64.b64decode(piece.data)
            pieces += 1
        transcript += piece.transcript or ""
    samples, rate = soundfile.read(io.BytesIO(audio), dtype="int16")
    assert rate == 24000 and samples.size > 0 and pieces >= 1
    assert transcript  # the spoken reply's text


def test_chat_text_only_and_speech_route(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
    reply = client.chat.completions.create(model="qwen3-omni", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=3)
    assert reply.choices[0].message.audio is None
    speech = client.audio.speech.create(model="qwen3-omni", voice="chelsie", input="Hello there.",
                                        response_format="wav", extra_body={"seed": SEED})
    samples, rate = soundfile.read(io.BytesIO(speech.read()), dtype="int16")
    assert rate == 24000 and samples.size > 0


def test_bad_voices_are_4xx_naming_the_field(server):
    r = httpx.post(f"{server.url}/v1/audio/speech", json={"model": "qwen3-omni", "input": "hi", "voice": "alloy"},
                   timeout=30)
    assert r.status_code == 400 and "alloy" in r.text
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "model": "qwen3-omni", "messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"],
        "audio": {"voice": "alloy", "format": "wav"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "audio.voice"


def test_chat_takes_audio_and_image_parts(server):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    soundfile.write(buf, (rng.standard_normal(8000) * 0.1).astype(np.float32), 8000, format="WAV", subtype="PCM_16")
    wav = base64.b64encode(buf.getvalue()).decode()
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(buf, format="PNG")
    png = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
    reply = client.chat.completions.create(model="qwen3-omni", max_tokens=3, messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
        {"type": "image_url", "image_url": {"url": png}}, {"type": "text", "text": "What is this?"}]}])
    assert reply.usage.prompt_tokens > 20  # the placeholders were expanded to the encoders' token counts
