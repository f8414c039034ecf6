"""Thinker and speaking side in two worker processes: the same tokens, codes and audio as colocated."""

import asyncio
from pathlib import Path

import pytest
import torch

from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import load_placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from tests.qwen_omni.test_reference_speech import chat_ids

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # two worker processes: ~30 s
PLACEMENT = Path(__file__).resolve().parents[2] / "mstar_qwen_omni" / "placement" / "qwen3-omni-partitions.yaml"


async def speak(placement, ids):
    engine = placed_engine(discover())
    try:
        await engine.load_model("qwen3-omni", LoadOptions(preset="tiny"),
                                **({"placement": load_placement(PLACEMENT)} if placement else {}))
        request = {"prompt_ids": ids, "speaker": "ethan", "max_tokens": 5, "talker_max_tokens": 30,
                   "talker_temperature": 0.0}
        outs = [o async for o in engine.submit("qwen3-omni", request)]
        return ([o.value for o in outs if o.name == "next_token"],
                torch.stack([o.value for o in outs if o.name == "codes" and o.value is not None]),
                torch.cat([o.value for o in outs if o.name == "audio"]))
    finally:
        await engine.close()


def test_two_partitions_equal_colocated(tiny_dir):
    from mstar_core.checkpoint import load_tokenizer

    ids = chat_ids(load_tokenizer(tiny_dir), "Hello! What is in this picture?")
    here = asyncio.run(speak(False, ids))
    apart = asyncio.run(speak(True, ids))
    assert here[0] == apart[0]
    assert torch.equal(here[1], apart[1])
    assert torch.equal(here[2], apart[2])
