"""Audio in a Qwen3-Omni chat is bounded by what fits the Thinker's context (a 413 from the WAV header), and an
allowed long part is resampled off the event loop (/health keeps answering meanwhile)."""

from __future__ import annotations

import base64
import io
import threading
import time

import httpx
import numpy as np
import pytest
import soundfile
from mstar_qwen_omni.adapter import CONTEXT_RESERVE, audio_seconds_that_fit

from tests.server.helpers import Server


def wav_1khz_u8(seconds: float) -> str:
    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(int(seconds * 1000), dtype=np.float32), 1000, format="WAV", subtype="PCM_U8")
    return base64.b64encode(buf.getvalue()).decode()


def chat(seconds: float) -> dict:
    part = {"type": "input_audio", "input_audio": {"data": wav_1khz_u8(seconds), "format": "wav"}}
    return {"model": "qwen3-omni", "max_tokens": 1,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "what is it?"}]}]}


@pytest.fixture(scope="module")
def omni_server(preset_cache):
    srv = Server(["qwen3-omni"], api_key=None, plugins=())
    yield srv
    srv.stop()


def test_limit_is_what_fits_the_context(tiny_dir):
    from mstar_qwen_omni.checkpoint import read_config
    from mstar_qwen_omni.config import OmniConfig

    cfg = OmniConfig.from_hf(read_config(tiny_dir))
    seconds = audio_seconds_that_fit(cfg)
    assert seconds * 13 <= cfg.thinker.text.max_position_embeddings - CONTEXT_RESERVE < (seconds + 1) * 13


def test_audio_that_can_never_fit_is_413_from_the_header(omni_server):
    t0 = time.perf_counter()
    resp = httpx.post(f"{omni_server.url}/v1/chat/completions", json=chat(599), timeout=60)
    assert resp.status_code == 413, resp.text
    assert resp.json()["error"]["param"] == "messages[0].content[0].input_audio"
    assert time.perf_counter() - t0 < 1.0


def test_health_answers_while_long_audio_is_resampled(omni_server):
    done = {}

    def send():
        done["resp"] = httpx.post(f"{omni_server.url}/v1/chat/completions", json=chat(120), timeout=120)

    sender = threading.Thread(target=send)
    sender.start()
    worst = 0.0
    while sender.is_alive():
        t0 = time.perf_counter()
        assert httpx.get(f"{omni_server.url}/health", timeout=30).status_code == 200
        worst = max(worst, time.perf_counter() - t0)
        time.sleep(0.05)
    sender.join()
    assert done["resp"].status_code == 200, done["resp"].text
    assert worst < 1.0, worst
