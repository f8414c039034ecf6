"""POST /v1/audio/transcriptions with the official client: json, text, verbose_json, streamed deltas, bad input."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile

from tests.realtime.helpers import tone

pytest.importorskip("openai")


def _wav(seconds: float = 1.0, rate: int = 24000) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, tone(seconds).astype(np.float32) / 32768.0, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _client(srv):
    from openai import OpenAI

    from tests.server.helpers import API_KEY

    return OpenAI(base_url=srv.url + "/v1", api_key=API_KEY)


def test_formats_and_stream_agree(rt_server):
    c = _client(rt_server)
    audio = ("speech.wav", _wav(), "audio/wav")
    plain = c.audio.transcriptions.create(model="qwen3-omni", file=audio)
    assert isinstance(plain.text, str) and plain.usage.input_tokens > 20 and plain.usage.output_tokens >= 1
    text = c.audio.transcriptions.create(model="qwen3-omni", file=audio, response_format="text")
    assert text == plain.text, (repr(text), repr(plain.text))  # greedy: the same words whatever the format
    verbose = c.audio.transcriptions.create(model="qwen3-omni", file=audio, response_format="verbose_json")
    assert verbose.text == plain.text and verbose.duration == pytest.approx(1.0, abs=0.01)
    assert verbose.language == "unknown"  # no language detection runs
    events = list(c.audio.transcriptions.create(model="qwen3-omni", file=audio, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "transcript.text.delta")
    done = events[-1]
    assert done.type == "transcript.text.done" and done.text == deltas == plain.text
    assert done.usage.output_tokens == plain.usage.output_tokens


def test_bad_uploads_name_the_field(rt_server):
    import openai

    c = _client(rt_server)
    with pytest.raises(openai.BadRequestError) as err:
        c.audio.transcriptions.create(model="qwen3-omni", file=("x.wav", b"not audio at all", "audio/wav"))
    assert err.value.body["param"] == "file"
    with pytest.raises(openai.BadRequestError) as err:
        c.audio.transcriptions.create(model="qwen3-omni", file=("x.wav", _wav(), "audio/wav"), response_format="srt")
    assert err.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as err:
        c.audio.transcriptions.create(model="toy-chat", file=("x.wav", _wav(), "audio/wav"))
    assert err.value.body["param"] == "model"


def test_word_timestamps_from_a_chat_model_are_a_400_naming_the_field(rt_server):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        _client(rt_server).audio.transcriptions.create(model="qwen3-omni", file=("x.wav", _wav(), "audio/wav"),
                                                       response_format="verbose_json", timestamp_granularities=["word"])
    assert err.value.body["param"] == "timestamp_granularities"


def test_audio_too_long_for_its_answer_is_a_413_from_its_header(rt_server):
    """300 s of 48 kHz FLAC (40 KB): under chat's audio bound for the tiny model (310 s), but its prompt and the
    transcription's output budget together pass the context; refused before decoding, naming the file."""
    import httpx

    from tests.server.helpers import API_KEY

    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(300 * 48_000, np.float32), 48_000, format="FLAC", subtype="PCM_16")
    r = httpx.post(rt_server.url + "/v1/audio/transcriptions", headers={"Authorization": f"Bearer {API_KEY}"},
                   files={"file": ("long.flac", buf.getvalue(), "audio/flac")}, data={"model": "qwen3-omni"},
                   timeout=60)
    assert r.status_code == 413 and r.json()["error"]["param"] == "file", r.text
    assert "300.0 s long" in r.json()["error"]["message"]
