"""The official `openai` client against a real server: models, chat (streaming and not), speech (wav/pcm/flac/SSE)."""

from __future__ import annotations

import base64
import io
import json
import struct

import httpx
import numpy as np
import pytest
import soundfile
from openai import OpenAI

from tests.server.toy.mstar_toy_models import SAMPLE_RATE, SAMPLES_PER_CHUNK, tokenizer


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=60)


def expected_audio(text: str, freq: float) -> np.ndarray:
    t = np.arange(len(text) * SAMPLES_PER_CHUNK) / SAMPLE_RATE
    return (np.clip(0.5 * np.sin(2 * np.pi * freq * t).astype(np.float32), -1, 1) * 32767).round().astype(np.int16)


def test_models_list(client):
    ids = sorted(m.id for m in client.models.list().data)
    assert ids == ["fixture-echo", "toy-chat", "toy-image", "toy-tts"]


def test_chat_non_streaming_echoes_with_usage(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo, wörld ✓"}]
    reply = client.chat.completions.create(model="toy-chat", messages=messages)
    assert reply.choices[0].message.content == "héllo, wörld ✓"
    assert reply.choices[0].finish_reason == "stop"
    tok = tokenizer()
    prompt = "<system>be brief\n<user>héllo, wörld ✓\n"
    assert reply.usage.prompt_tokens == len(tok.encode(prompt).ids)
    # one token per UTF-8 byte, plus the EOS that ended the reply
    assert reply.usage.completion_tokens == len("héllo, wörld ✓".encode()) + 1
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_streaming_deltas_join_to_the_reply(client):
    stream = client.chat.completions.create(
        model="toy-chat", messages=[{"role": "user", "content": "naïve café"}], stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "naïve café"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].usage.completion_tokens == len("naïve café".encode()) + 1


def test_chat_max_tokens_and_stop(client):
    reply = client.chat.completions.create(model="toy-chat", messages=[{"role": "user", "content": "abcdefgh"}],
                                           max_tokens=3)
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == ("abc", "length")
    assert reply.usage.completion_tokens == 3
    reply = client.chat.completions.create(model="toy-chat", messages=[{"role": "user", "content": "one two three"}],
                                           stop=[" thr", "zzz"])
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == ("one two", "stop")
    stream = client.chat.completions.create(model="toy-chat", messages=[{"role": "user", "content": "one two three"}],
                                            stop="two", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "one "


def _parse_wav(data: bytes) -> tuple[int, np.ndarray]:
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt "
    channels, rate = struct.unpack("<HI", data[22:28])
    assert channels == 1 and data[36:40] == b"data"
    return rate, np.frombuffer(data[44:], dtype="<i2")


@pytest.mark.parametrize("voice,freq", [("alpha", 220.0), ("beta", 330.0)])
def test_speech_wav_streaming(client, voice, freq):
    text = "Hi there"
    with client.audio.speech.with_streaming_response.create(
        model="toy-tts", voice=voice, input=text, response_format="wav"
    ) as resp:
        pieces = list(resp.iter_bytes())
    rate, samples = _parse_wav(b"".join(pieces))
    assert rate == SAMPLE_RATE
    np.testing.assert_array_equal(samples, expected_audio(text, freq))


def test_speech_wav_whole_file_has_exact_header(client):
    text = "whole file"
    audio = client.audio.speech.create(model="toy-tts", voice="alpha", input=text, response_format="wav",
                                       extra_body={"stream": False})
    decoded, rate = soundfile.read(io.BytesIO(audio.content), dtype="int16")
    assert rate == SAMPLE_RATE
    np.testing.assert_array_equal(decoded, expected_audio(text, 220.0))


def test_speech_pcm_and_flac(client):
    text = "pcm"
    pcm = client.audio.speech.create(model="toy-tts", voice="beta", input=text, response_format="pcm").content
    np.testing.assert_array_equal(np.frombuffer(pcm, dtype="<i2"), expected_audio(text, 330.0))
    flac = client.audio.speech.create(model="toy-tts", voice="beta", input=text, response_format="flac").content
    decoded, rate = soundfile.read(io.BytesIO(flac), dtype="int16")
    assert rate == SAMPLE_RATE
    np.testing.assert_array_equal(decoded, expected_audio(text, 330.0))


def test_speech_without_a_format_is_mp3_as_openai(client):
    """OpenAI's route answers mp3 when response_format is left out; the audio decodes to the model's samples'
    length (MP3's priming and padding aside)."""
    import av

    text = "mp3 by default"
    with client.audio.speech.with_streaming_response.create(model="toy-tts", voice="alpha", input=text) as resp:
        assert resp.headers["content-type"] == "audio/mpeg"
        data = b"".join(resp.iter_bytes())
    assert data[:3] == b"ID3" or (data[0] == 0xFF and data[1] & 0xE0 == 0xE0)  # a tag, or an MPEG frame sync
    with av.open(io.BytesIO(data), format="mp3") as container:
        stream = container.streams.audio[0]
        decoded = sum(f.samples for f in container.decode(stream))
        rate = stream.codec_context.sample_rate
    want = expected_audio(text, 220.0).size
    assert rate == SAMPLE_RATE and abs(decoded - want) < 0.1 * SAMPLE_RATE


def test_speech_sse_deltas_and_usage(server):
    body = {"model": "toy-tts", "input": "sse!", "voice": "alpha", "response_format": "pcm", "stream_format": "sse"}
    events = []
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", json=body, headers=server.headers, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) == 4  # one per character: streamed as produced, not at the end
    pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    np.testing.assert_array_equal(np.frombuffer(pcm, dtype="<i2"), expected_audio("sse!", 220.0))
    assert events[-1] == {"type": "speech.audio.done", "usage": {"input_tokens": 4, "output_tokens": 0, "total_tokens": 4}}


def test_images_generate_through_adapter(client):
    from PIL import Image

    result = client.images.generate(model="toy-image", prompt="a flat colour", size="8x4", n=2,
                                    response_format="b64_json", extra_body={"seed": 5})
    colours = []
    for i, item in enumerate(result.data):
        img = np.asarray(Image.open(io.BytesIO(base64.b64decode(item.b64_json))))
        assert img.shape == (4, 8, 3) and (img == img[0, 0]).all()
        import torch

        expected = torch.randint(0, 256, (3,), generator=torch.Generator().manual_seed(5 + i), dtype=torch.uint8)
        assert img[0, 0].tolist() == expected.tolist()
        colours.append(tuple(img[0, 0]))
    assert colours[0] != colours[1]  # n images get distinct seeds
