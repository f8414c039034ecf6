"""Every model family loads its tiny preset in bf16 (`LoadOptions(dtype="bfloat16")`) and answers its own example with finite outputs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mstar_core.model import LoadOptions

#: family -> nodes whose weights must be bf16 (codecs and VAE decoders may keep fp32 on purpose)
FAMILIES = {
    "llama": ("lm",),
    "orpheus": ("lm",),
    "qwen3-omni": ("thinker", "talker"),
    "qwen3-tts": ("talker", "code_predictor"),
    "bagel": ("llm", "vit"),
    "pi05": ("vlm", "expert"),
    "vjepa2": ("encoder", "predictor"),
    "vjepa2-ac": ("encoder", "ac_predictor"),
}


def _finite(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or bool(torch.isfinite(value.float()).all())
    if isinstance(value, list | tuple):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return not isinstance(value, float) or value == value and abs(value) != float("inf")


def _float_dtypes(module: Any) -> set[torch.dtype]:
    """Floating dtypes of a node module's parameters (or of the torch modules a plain node object holds)."""
    modules = [module] if isinstance(module, torch.nn.Module) else [
        v for v in vars(module).values() if isinstance(v, torch.nn.Module)] if hasattr(module, "__dict__") else []
    return {p.dtype for m in modules for p in m.parameters() if p.is_floating_point()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_family_answers_its_example_in_bf16_with_finite_outputs(family, preset_cache):
    from mstar_core.plugins.manager import discover
    from mstar_core.runtime import AsyncEngine

    spec = discover().models.get(family)
    if spec is None:
        pytest.skip(f"{family} is not installed")
    async with AsyncEngine() as engine:
        loaded = await engine.load_model(family, LoadOptions(preset="tiny", dtype="bfloat16"))
        dtypes = {name: _float_dtypes(node.module()) for name, node in loaded.graph.nodes.items() if node.module is not None}
        for node in FAMILIES[family]:
            assert dtypes[node] == {torch.bfloat16}, (node, dtypes[node])
        assert torch.bfloat16 in set().union(*dtypes.values()), dtypes  # the model's weights are (mostly) bf16
        handle = engine.submit(family, spec.example, timeout=300)
        outputs = [o async for o in handle]
        env = await handle.result()
    assert outputs or env, family
    assert all(_finite(o.value) for o in outputs), family
    assert _finite(dict(env)), family
