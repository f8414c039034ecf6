"""The Thinker split over 2 gloo ranks (experts 4 + 4, or by columns): text, codes and audio equal colocated's."""

import asyncio

import attrs
import pytest
import torch
import yaml

from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import load_placement
from mstar_core.config.placement import WorkerSpec
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from tests.qwen_omni.test_reference_speech import chat_ids

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # a rank group of two processes: ~40 s
if "tensor_parallel" not in {field.name for field in attrs.fields(WorkerSpec)}:
    pytest.skip("this runtime has no rank groups (placement tensor_parallel)", allow_module_level=True)


async def speak(placement, ids):
    engine = placed_engine(discover())
    try:
        await engine.load_model("qwen3-omni", LoadOptions(preset="tiny"),
                                **({"placement": load_placement(placement)} if placement else {}))
        request = {"prompt_ids": ids, "speaker": "ethan", "max_tokens": 6, "temperature": 0.0,
                   "talker_max_tokens": 30, "talker_temperature": 0.0}
        outs = [o async for o in engine.submit("qwen3-omni", request)]
        return ([o.value for o in outs if o.name == "next_token"],
                torch.stack([o.value for o in outs if o.name == "codes" and o.value is not None]),
                torch.cat([o.value for o in outs if o.name == "audio"]))
    finally:
        await engine.close()


@pytest.mark.parametrize("expert_parallel", [2, 1])
def test_thinker_tp2_speaks_as_tp1(tiny_dir, tmp_path, expert_parallel):
    from mstar_core.checkpoint import load_tokenizer

    placement = tmp_path / "tp2.yaml"
    worker = {"device": "cpu", "tensor_parallel": 2, "threads": 1}
    if expert_parallel > 1:
        worker["expert_parallel"] = expert_parallel
    placement.write_text(yaml.safe_dump({"workers": {"thinker": worker}, "nodes": {"thinker": "thinker"}}))
    ids = chat_ids(load_tokenizer(tiny_dir), "Hello! What is in this picture?")
    here = asyncio.run(speak(None, ids))
    split = asyncio.run(speak(placement, ids))
    assert split[0] == here[0]
    assert torch.equal(split[1], here[1])
    assert torch.allclose(split[2], here[2], atol=1e-4)
