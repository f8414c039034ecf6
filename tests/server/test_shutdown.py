"""SIGTERM drains: an in-flight stream finishes, new requests are refused, the process exits cleanly."""

from __future__ import annotations

import signal
import threading
import time

import httpx

from tests.server.helpers import Server
from tests.server.toy.mstar_toy_models import SAMPLES_PER_CHUNK


def test_sigterm_drains_in_flight_stream():
    srv = Server(["toy-tts"], "--drain-timeout", "20", api_key=None, MSTAR_TOY_STEP_DELAY="0.02")
    text = "x" * 40
    got = []
    try:
        body = {"model": "toy-tts", "input": text, "voice": "alpha", "response_format": "pcm"}
        with httpx.stream("POST", f"{srv.url}/v1/audio/speech", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            chunks = resp.iter_bytes()
            got.append(next(chunks))
            threading.Timer(0.05, srv.proc.send_signal, args=(signal.SIGTERM,)).start()
            for data in chunks:
                got.append(data)
        assert sum(map(len, got)) == len(text) * SAMPLES_PER_CHUNK * 2, "the in-flight stream was cut"
        deadline = time.monotonic() + 20
        while srv.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert srv.proc.returncode in (0, -signal.SIGTERM), srv.output()
        assert "Traceback" not in srv.serving_output(), srv.serving_output()
    finally:
        srv.stop()
