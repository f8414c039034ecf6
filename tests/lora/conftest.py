"""The tiny Llama preset with two PEFT adapters over it, written once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_adapters(preset_cache, tmp_path_factory):
    """(preset dir, {name: (adapter dir, peft model)}) over the tiny Llama preset's own weights."""
    pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from mstar_llm.preset import ensure_tiny

    from tests.lora.peft_fixtures import make_adapter

    tiny = ensure_tiny()
    base = transformers.LlamaForCausalLM.from_pretrained(tiny).eval()
    root = tmp_path_factory.mktemp("adapters")
    made = {
        "sql": make_adapter(base, root / "sql", seed=1, r=4),
        "poet": make_adapter(base, root / "poet", seed=2, r=8, targets=("q_proj", "k_proj", "v_proj", "down_proj")),
        "third": make_adapter(base, root / "third", seed=3, r=2, targets=("o_proj", "up_proj")),
    }
    return tiny, {name: (root / name, model) for name, model in made.items()}
