"""Session fixtures: a real `mstar serve` process on loopback, serving the toy models (and fixture-echo) behind an API key."""

from __future__ import annotations

import pytest

from tests.server.helpers import Server


def _serve_then_check(srv: Server):
    """Yield `srv`; afterwards it must exit 0 and have logged no traceback while serving (startup excluded)."""
    yield srv
    code = srv.stop()
    assert code == 0, f"server did not shut down cleanly (exit {code}):\n{srv.output()[-3000:]}"
    assert "Traceback" not in srv.serving_output(), srv.serving_output()[-3000:]


@pytest.fixture(scope="session")
def server():
    yield from _serve_then_check(Server(["toy-tts", "toy-chat", "toy-image", "fixture-echo"],
                                        MSTAR_TOY_STEP_DELAY="0.002"))


@pytest.fixture(scope="session")
def edge_server():
    """The toy models plus the tiny llama and orpheus presets: every route and the native endpoint over real
    `prepare` code (SamplingParams included), for the edge validation and fuzz tests."""
    pytest.importorskip("mstar_llm")
    pytest.importorskip("mstar_orpheus")
    # no request may leave a traceback (what plugins logged while loading is not the edge's business)
    yield from _serve_then_check(Server(["llama", "orpheus", "toy-tts", "toy-chat", "toy-image", "fixture-echo"],
                                        MSTAR_TOY_STEP_DELAY="0.002"))
