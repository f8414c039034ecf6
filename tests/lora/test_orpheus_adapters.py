"""LoRA adapters on the Orpheus LM: a request naming the adapter speaks as the base checkpoint with peft's merge of
the adapter does (the same seed, the same audio tokens)."""

from __future__ import annotations

import shutil

import pytest

from mstar_core.config.lora import LoraSettings
from mstar_core.model import LoadOptions

pytest.importorskip("mstar_orpheus")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")


async def test_orpheus_adapter_speaks_as_the_merged_checkpoint(preset_cache, tmp_path):
    from mstar_orpheus.preset import ensure_preset

    from mstar_core.checkpoint import save_hf_checkpoint
    from mstar_core.runtime import AsyncEngine
    from tests.lora.peft_fixtures import make_adapter

    preset = ensure_preset("tiny")
    base = transformers.LlamaForCausalLM.from_pretrained(preset).eval()
    voice = make_adapter(base, tmp_path / "voice", seed=5, r=4)
    merged_dir = tmp_path / "merged"  # the preset with the adapter merged into its LM (SNAC and tokenizer kept)
    top = str(preset)
    shutil.copytree(preset, merged_dir, ignore=lambda folder, names: [n for n in names if folder == top
                                                                       and n.startswith("model")])
    merged = voice.merge_and_unload()
    save_hf_checkpoint(merged, merged_dir, merged.config.to_dict())

    engine = AsyncEngine()
    try:
        await engine.load_model("orpheus", LoadOptions(preset="tiny"), alias="orpheus")
        await engine.load_model("orpheus", LoadOptions(checkpoint=str(merged_dir)), alias="merged")
        await engine.enable_lora("orpheus", LoraSettings(adapters={"voice": str(tmp_path / "voice")}))

        async def tokens(model):
            handle = await engine.submit_async(model, {"text": "Hello there.", "voice": "tara", "max_tokens": 28,
                                                       "seed": 3})
            return [int(o.value) async for o in handle if o.name == "next_token"]

        adapted, want, plain = await tokens("voice"), await tokens("merged"), await tokens("orpheus")
        assert adapted == want
        assert adapted != plain
    finally:
        await engine.close()
