"""One `mstar serve bagel` (tiny) for every served-BAGEL test module of a run, driven by the official openai client."""

from __future__ import annotations

import pytest

from tests.server.helpers import Server


@pytest.fixture(scope="session")
def client():
    openai = pytest.importorskip("openai")
    server = Server(["bagel"], api_key=None, wait=False)
    server.wait_ready(240)  # BAGEL's tiny preset loads in seconds; a loaded CI machine takes longer
    try:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    finally:
        server.stop()
