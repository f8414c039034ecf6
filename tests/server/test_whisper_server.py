"""`mstar serve whisper` (the tiny preset, no other options) through the official openai client: transcriptions in
every response format (verbose_json segments, srt, vtt), streamed text deltas, and translations; audio from espeak-ng."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.server.helpers import Server

pytest.importorskip("mstar_whisper")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow  # a server boot and a few 30-second windows on 2 shared CPU cores


@pytest.fixture(scope="module")
def whisper():
    srv = Server(["whisper"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("audio") / "hello.wav"
    if shutil.which("espeak-ng") is not None:
        subprocess.run(["espeak-ng", "-w", str(path), "Hello from M star. This is a test of speech recognition."],
                       check=True)
    else:  # (no espeak-ng here: a voiced-looking synthetic signal at 22.05 kHz, resampled by the server)
        import soundfile
        import torch

        from tests.whisper.helpers import speech

        wave = torch.nn.functional.interpolate(speech(3.0, seed=1)[None, None], scale_factor=22050 / 16000)[0, 0]
        soundfile.write(str(path), wave.numpy(), 22050)
    return path


def _client(srv):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=srv.api_key, max_retries=0, timeout=300)


def test_verbose_json_srt_vtt(whisper, clip):
    client = _client(whisper)
    with open(clip, "rb") as f:
        verbose = client.audio.transcriptions.create(model="whisper", file=f, response_format="verbose_json",
                                                     timestamp_granularities=["segment"])
    assert verbose.duration > 1 and verbose.language and verbose.segments
    for seg in verbose.segments:
        assert 0 <= seg.start <= seg.end <= 30 and seg.avg_logprob <= 0
        assert 0 <= seg.no_speech_prob <= 1 and seg.compression_ratio >= 0
    with open(clip, "rb") as f:
        srt = client.audio.transcriptions.create(model="whisper", file=f, response_format="srt")
    assert re.match(r"1\n\d\d:\d\d:\d\d,\d{3} --> \d\d:\d\d:\d\d,\d{3}\n", srt)
    with open(clip, "rb") as f:
        vtt = client.audio.transcriptions.create(model="whisper", file=f, response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n") and "-->" in vtt
    with open(clip, "rb") as f:
        plain = client.audio.transcriptions.create(model="whisper", file=f, response_format="json", language="en")
    assert isinstance(plain.text, str)


def test_stream_deltas_add_up_to_the_text(whisper, clip):
    client = _client(whisper)
    with open(clip, "rb") as f:
        events = list(client.audio.transcriptions.create(model="whisper", file=f, stream=True, language="en",
                                                         temperature=0.0))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    done = [e for e in events if e.type == "transcript.text.done"]
    assert len(done) == 1 and "".join(deltas).strip() == done[0].text
    assert len(deltas) > 1  # the text came as it was written, not at the end


def test_translations(whisper, clip):
    client = _client(whisper)
    with open(clip, "rb") as f:
        out = client.audio.translations.create(model="whisper", file=f)
    assert isinstance(out.text, str)
    with open(clip, "rb") as f:
        with pytest.raises(openai.BadRequestError, match="response_format"):
            client.audio.translations.create(model="whisper", file=f, response_format="mp3")


def test_long_audio_runs_the_long_form_walk(whisper, tmp_path):
    import soundfile
    import torch

    from tests.whisper.helpers import speech

    path = tmp_path / "long.wav"
    soundfile.write(str(path), torch.cat([speech(25.0, seed=2), speech(20.0, seed=3)]).numpy(), 16000)
    client = _client(whisper)
    with open(path, "rb") as f:
        out = client.audio.transcriptions.create(model="whisper", file=f, response_format="verbose_json",
                                                 language="en", timestamp_granularities=["segment"])
    assert abs(out.duration - 45.0) < 0.01 and out.segments
    starts = [s.start for s in out.segments]
    assert starts == sorted(starts) and all(s.start <= s.end for s in out.segments)
    assert out.segments[-1].end > 30  # the second window's segments, offset by its seek


def test_word_timestamps(whisper, clip):
    client = _client(whisper)
    for granularities in (["word"], ["word", "segment"]):
        with open(clip, "rb") as f:
            out = client.audio.transcriptions.create(model="whisper", file=f, response_format="verbose_json",
                                                     language="en", timestamp_granularities=granularities)
        assert out.words and out.segments
        starts = [w.start for w in out.words]
        assert starts == sorted(starts) and all(0 <= w.start <= w.end <= out.duration for w in out.words)
        assert all(w.word and w.word == w.word.strip() for w in out.words)
    for fmt, granularity in (("text", "word"), ("json", "word"), ("srt", "word"), ("verbose_json", "character")):
        # as OpenAI: timestamp granularities need verbose_json
        with open(clip, "rb") as f, pytest.raises(openai.BadRequestError) as err:
            client.audio.transcriptions.create(model="whisper", file=f, response_format=fmt,
                                               timestamp_granularities=[granularity])
        assert err.value.body["param"] == "timestamp_granularities", fmt


def test_long_audio_words_are_offset_by_each_window(whisper, tmp_path):
    import soundfile
    import torch

    from tests.whisper.helpers import speech

    path = tmp_path / "long.wav"
    soundfile.write(str(path), torch.cat([speech(25.0, seed=2), speech(20.0, seed=3)]).numpy(), 16000)
    with open(path, "rb") as f:
        out = _client(whisper).audio.transcriptions.create(model="whisper", file=f, response_format="verbose_json",
                                                           language="en", timestamp_granularities=["word"])
    starts = [w.start for w in out.words]
    assert starts == sorted(starts) and all(0 <= w.start <= w.end <= 45.0 for w in out.words)
    assert out.words[-1].start > 30  # the second window's words, offset by its seek
