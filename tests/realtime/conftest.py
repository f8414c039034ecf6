"""A served qwen3-omni and llama (tiny presets) and the toy chat and speech models, for the realtime tests."""

from __future__ import annotations

import pytest

from tests.server.helpers import Server

#: small bounds so the limit tests need little data
LIMITS = {"MSTAR_REALTIME_MAX_EVENT_BYTES": "262144", "MSTAR_REALTIME_MAX_BUFFER_SECONDS": "3",
          "MSTAR_REALTIME_MAX_SESSIONS": "4", "MSTAR_REALTIME_VAD": "energy"}


@pytest.fixture(scope="session")
def rt_server():
    pytest.importorskip("mstar_qwen_omni")
    pytest.importorskip("mstar_llm")
    srv = Server(["qwen3-omni", "llama", "toy-chat", "toy-tts"], MSTAR_TOY_STEP_DELAY="0.01", **LIMITS)
    yield srv
    assert srv.stop() == 0, srv.output()[-3000:]
    assert "Traceback" not in srv.serving_output(), srv.serving_output()[-3000:]
