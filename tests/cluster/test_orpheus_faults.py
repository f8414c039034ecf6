"""Disaggregated tiny Orpheus when its codec worker dies (issue 10, finding 5, as reported).

The SNAC codec is a stream consumer in its own process: when it dies, the request fails within
about a second and the LM stops computing it (its KV pages come back), instead of the LM running
on for seconds and the request failing when its loop ends.
"""

from pathlib import Path

import pytest

from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import load_placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from tests.cluster.helpers import kill_mid_request, kv_pages_used, until

pytest.importorskip("mstar_orpheus")
pytestmark = pytest.mark.timeout(240)

PLACEMENT = Path(__file__).resolve().parents[2] / "examples" / "placement" / "orpheus-disaggregated.yaml"
LONG = {"text": "Hello from M star, " * 8, "voice": "tara", "seed": 7, "max_tokens": 4000}


async def test_a_dead_codec_worker_fails_its_request_at_once_and_the_lm_stops_computing_it():
    engine = placed_engine(discover())
    await engine.load_model("orpheus", LoadOptions(preset="tiny"), placement=load_placement(PLACEMENT))
    codec = engine.cluster.workers["codec"]
    try:
        await kill_mid_request(engine, "orpheus", LONG, "codec", "audio")
        assert await kv_pages_used(engine, "lm", "orpheus/lm") == 0  # the LM dropped it
        await until(lambda: codec.ready, 90, "the codec worker to come back")
        chunks = [o async for o in engine.submit("orpheus", {**LONG, "max_tokens": 120}) if o.name == "audio"]
        assert chunks  # served again after the codec came back
    finally:
        await engine.close()

