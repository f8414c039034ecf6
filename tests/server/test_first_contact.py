"""First contact (issue 28): the official `openai` client against `mstar serve bagel orpheus qwen3-omni` with no
options, as a new user tries it: images with no size, each standard size and n=2, an edit, chat with an image
(usage counts its block), Qwen3-Omni text and spoken replies that are not empty, speech in every format decoded
back by PyAV at the expected rate and length, and a `speed` the model does not take refused by name."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from tests.server.helpers import Server

openai = pytest.importorskip("openai")
av = pytest.importorskip("av")
Image = pytest.importorskip("PIL.Image")
RATE = 24000


@pytest.fixture(scope="module")
def client():
    server = Server(["bagel", "orpheus", "qwen3-omni"], api_key=None, plugins=(), wait=False)
    try:
        server.wait_ready(300)
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)
    finally:
        server.stop()


def _size(item) -> tuple[int, int]:
    return Image.open(io.BytesIO(base64.b64decode(item.b64_json))).size


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 10)).save(buf, format="PNG")
    return buf.getvalue()


def _decode(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    """Samples and sample rate as PyAV (FFmpeg) reads them back; pcm is raw s16le mono at the server's rate."""
    opts = {"format": "s16le", "options": {"sample_rate": str(RATE), "ch_layout": "mono"}} if fmt == "pcm" else {
        "format": {"opus": "ogg", "aac": "aac"}.get(fmt, fmt)}  # named: a probe of a few frames can come up short
    with av.open(io.BytesIO(data), **opts) as container:
        stream = container.streams.audio[0]
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(stream)]
        return (np.concatenate(frames) if frames else np.zeros(0)), stream.codec_context.sample_rate


def test_models_say_what_each_takes(client):
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    bagel = cards["bagel"]
    assert {"256x256", "512x512", "1024x1024"} <= set(bagel["image_sizes"]) and bagel["default_image_size"] == "256x256"
    orpheus = cards["orpheus"]
    assert orpheus["voices"][0] == "tara" and set(orpheus["audio_formats"]) == {"wav", "pcm", "flac", "mp3", "opus", "aac"}
    assert orpheus["speed"] is False and cards["qwen3-omni"]["voices"]


def test_images_with_no_size_are_the_default_one(client):
    r = client.images.generate(model="bagel", prompt="a red cube on a wooden table")
    assert len(r.data) == 1 and _size(r.data[0]) == (256, 256)


@pytest.mark.parametrize("size", ["256x256", "512x512", "1024x1024"])
def test_each_standard_size(client, size):
    r = client.images.generate(model="bagel", prompt="a red cube", size=size, extra_body={"seed": 1, "num_steps": 1})
    assert _size(r.data[0]) == tuple(int(v) for v in size.split("x"))


def test_n_2_gives_two_images_seeded_apart(client):
    r = client.images.generate(model="bagel", prompt="two cubes", n=2, extra_body={"seed": 4, "num_steps": 2})
    one = client.images.generate(model="bagel", prompt="two cubes", extra_body={"seed": 5, "num_steps": 2})
    assert [_size(d) for d in r.data] == [(256, 256)] * 2 and r.data[1].b64_json == one.data[0].b64_json
    assert r.data[0].b64_json != r.data[1].b64_json


def test_edit(client):
    r = client.images.edit(model="bagel", prompt="make it blue", image=("in.png", _png(), "image/png"),
                           extra_body={"seed": 1, "num_steps": 1})
    w, h = _size(r.data[0])
    assert (w, h) == (64, 48)  # drawn on BAGEL's grid (short side 512), answered at the input's size (issue 49)


def test_chat_with_an_image_counts_its_block(client):
    url = "data:image/png;base64," + base64.b64encode(_png()).decode()
    text = client.chat.completions.create(model="bagel", max_tokens=3, messages=[
        {"role": "user", "content": "what is this?"}]).usage.prompt_tokens
    r = client.chat.completions.create(model="bagel", max_tokens=3, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is this?"}]}])
    assert text > 0 and r.usage.prompt_tokens > text + 4  # the ViT block's rows and delimiters count
    assert r.usage.completion_tokens >= 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_qwen3_omni_replies_in_text(client, seed):
    r = client.chat.completions.create(model="qwen3-omni", seed=seed, max_tokens=12, temperature=0.8,
                                       messages=[{"role": "user", "content": "Hello, who are you?"}])
    # text that ends: by itself (the preset ends its turns within a few dozen tokens) or at max_tokens
    choice = r.choices[0]
    assert choice.message.content and r.usage.completion_tokens >= 1
    assert choice.finish_reason == "stop" or (choice.finish_reason == "length" and r.usage.completion_tokens == 12)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_qwen3_omni_speaks_a_non_empty_waveform(client, seed):
    r = client.chat.completions.create(model="qwen3-omni", seed=seed, max_tokens=8, modalities=["text", "audio"],
                                       audio={"voice": "chelsie", "format": "wav"},
                                       messages=[{"role": "user", "content": "Hello!"}])
    samples, rate = _decode(base64.b64decode(r.choices[0].message.audio.data), "wav")
    assert rate == RATE and samples.size > 0 and r.choices[0].message.audio.transcript


@pytest.fixture(scope="module")
def reference_wav(client):
    """Orpheus' reply, seeded, as WAV: every other format must decode to as many seconds."""
    data = client.audio.speech.create(model="orpheus", voice="tara", input="Hello there!", response_format="wav",
                                      extra_body={"seed": 3, "max_tokens": 210}).content
    samples, rate = _decode(data, "wav")
    assert rate == RATE and samples.size > 0
    return samples


@pytest.mark.parametrize(("fmt", "rate"), [("pcm", RATE), ("flac", RATE), ("mp3", RATE), ("opus", 48000),
                                           ("aac", RATE)])
def test_speech_in_every_format_decodes_back(client, reference_wav, fmt, rate):
    with client.audio.speech.with_streaming_response.create(
            model="orpheus", voice="tara", input="Hello there!", response_format=fmt,
            extra_body={"seed": 3, "max_tokens": 210}) as response:
        data = b"".join(response.iter_bytes())
    samples, got_rate = _decode(data, fmt)
    assert got_rate == rate  # Opus decodes at its own 48 kHz
    seconds, want = samples.size / got_rate, reference_wav.size / RATE
    assert abs(seconds - want) < 0.1, (fmt, seconds, want)  # codec priming/padding: tens of ms at most
    if fmt in ("pcm", "flac"):
        assert samples.astype(np.int16).tolist() == reference_wav.tolist()  # lossless: the same samples


def test_qwen3_omni_speech_in_mp3(client):
    data = client.audio.speech.create(model="qwen3-omni", voice="ethan", input="Hello there, how are you?", response_format="mp3",
                                      extra_body={"seed": 0}).content
    samples, rate = _decode(data, "mp3")
    assert rate == RATE and samples.size > 0


def test_speed_the_model_does_not_take_is_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.speech.create(model="orpheus", voice="tara", input="Hi", speed=1.5)
    assert err.value.body["param"] == "speed" and "speed 1.0" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.speech.create(model="orpheus", voice="alloy", input="Hi")
    assert err.value.body["param"] == "voice" and "tara" in err.value.body["message"]
