"""Tiny Orpheus colocated and disaggregated (LM and codec in worker processes): identical audio."""

from pathlib import Path

import pytest
import torch

from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import load_placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover

pytest.importorskip("mstar_orpheus")
pytestmark = pytest.mark.timeout(180)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "placement"
REQUEST = {"text": "Hello from M star.", "voice": "tara", "seed": 7, "max_tokens": 120}


async def synthesize(placement_file):
    engine = placed_engine(discover())
    placement = load_placement(EXAMPLES / placement_file)
    await engine.load_model("orpheus", LoadOptions(preset="tiny"), placement=placement)
    try:
        chunks = []
        async for out in engine.submit("orpheus", dict(REQUEST)):
            if out.name == "audio":
                chunks.append(torch.as_tensor(out.value).clone())
        workers = sorted(engine.cluster.workers) if engine.cluster else []
        params = [p for node in engine.models["orpheus"].graph.nodes.values() for p in node.module().parameters()]
        return chunks, workers, {p.is_meta for p in params}
    finally:
        await engine.close()


async def test_colocated_and_disaggregated_orpheus_give_identical_audio():
    colocated, no_workers, local_meta = await synthesize("orpheus-colocated.yaml")
    split, workers, split_meta = await synthesize("orpheus-disaggregated.yaml")
    assert no_workers == [] and workers == ["codec", "lm"]
    # the serving process keeps the graph but no weights when every node runs in a worker
    assert local_meta == {False} and split_meta == {True}
    assert len(colocated) > 0, "the tiny preset should produce at least one audio window"
    assert len(split) == len(colocated)
    for a, b in zip(colocated, split, strict=True):
        assert torch.equal(a, b)
