"""LoRA adapters on the Qwen3-Omni Thinker: an adapter in PEFT's layout over the full checkpoint's names
(`thinker.model.layers.N.self_attn.q_proj`) writes as the Thinker with the adapter merged into its weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from mstar_core.config.lora import LoraSettings
from mstar_core.model import LoadOptions

pytest.importorskip("mstar_qwen_omni")

RANK, ALPHA = 4, 8.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _adapter(thinker, directory):
    """Random A and B on the Thinker's attention projections, written as PEFT writes them; their merged deltas."""
    directory.mkdir()
    gen = torch.Generator().manual_seed(9)
    shapes = {k[: -len(".weight")]: v.shape for k, v in thinker.state_dict().items()
              if k.startswith("model.layers.") and k.endswith(tuple(f"{t}.weight" for t in TARGETS))}
    tensors, deltas = {}, {}
    for name, (rows, cols) in shapes.items():
        a, b = torch.randn(RANK, cols, generator=gen) * 0.3, torch.randn(rows, RANK, generator=gen) * 0.3
        tensors[f"base_model.model.thinker.{name}.lora_A.weight"] = a
        tensors[f"base_model.model.thinker.{name}.lora_B.weight"] = b
        deltas[f"{name}.weight"] = (ALPHA / RANK) * b @ a
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": list(TARGETS), "bias": "none"}))
    return deltas


async def test_thinker_adapter_writes_as_the_merged_thinker(preset_cache, tmp_path):
    from mstar_core.runtime import AsyncEngine

    engine = AsyncEngine()
    try:
        await engine.load_model("qwen3-omni", LoadOptions(preset="tiny"), alias="omni")
        await engine.load_model("qwen3-omni", LoadOptions(preset="tiny"), alias="merged")
        thinker = engine.models["merged"].graph.nodes["thinker"].module()
        deltas = _adapter(thinker, tmp_path / "chatty")
        state = thinker.state_dict()
        with torch.no_grad():
            thinker.load_state_dict({k: v + deltas[k] if k in deltas else v for k, v in state.items()})
        await engine.enable_lora("omni", LoraSettings(adapters={"chatty": str(tmp_path / "chatty")}))

        async def tokens(model):
            handle = await engine.submit_async(model, {"messages": [{"role": "user", "content": "Hello there!"}],
                                                       "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            return [int(o.value) async for o in handle if o.name == "next_token"]

        adapted, want, plain = await tokens("chatty"), await tokens("merged"), await tokens("omni")
        assert adapted == want
        assert adapted != plain
    finally:
        await engine.close()
