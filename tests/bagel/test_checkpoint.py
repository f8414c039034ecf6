"""The published layout's quirks: a ViT checkpoint that still holds its last layer (never built: BAGEL reads the
penultimate one) and a conv patch embedding (converted to the linear over (row, col, channel) patches)."""

from __future__ import annotations

import shutil

import pytest
import torch
from mstar_bagel.checkpoint import EMA, TINY_TOP, ensure_tiny, load_bagel
from safetensors.torch import load_file, save_file

from mstar_core.checkpoint import WeightMismatchError


def test_dropped_last_vit_layer_and_conv_patch_embedding_load_to_the_same_model(tmp_path):
    src = ensure_tiny()
    shutil.copytree(src, tmp_path / "ck")
    ck = tmp_path / "ck"
    state = load_file(str(ck / EMA))
    bagel, _ = load_bagel(src, progress=False)
    c = bagel.config.vit
    prefix = "vit_model.vision_model."
    kept = c.num_hidden_layers  # the JSON says one more
    for name in [n for n in state if n.startswith(f"{prefix}encoder.layers.0.")]:
        state[name.replace("layers.0.", f"layers.{kept}.")] = torch.randn_like(state[name])
    linear = state[f"{prefix}embeddings.patch_embedding.weight"]
    state[f"{prefix}embeddings.patch_embedding.weight"] = (
        linear.reshape(linear.shape[0], c.patch_size, c.patch_size, c.num_channels).permute(0, 3, 1, 2).contiguous())
    save_file(state, str(ck / EMA))
    again, _ = load_bagel(ck, progress=False)
    pixels = torch.rand(3, 56, 84, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        assert torch.equal(again.vit_rows(pixels), bagel.vit_rows(pixels))


def test_a_missing_gen_expert_weight_is_named(tmp_path):
    src = ensure_tiny()
    shutil.copytree(src, tmp_path / "ck")
    state = load_file(str(tmp_path / "ck" / EMA))
    del state["language_model.model.layers.1.mlp_moe_gen.down_proj.weight"]
    save_file(state, str(tmp_path / "ck" / EMA))
    with pytest.raises(WeightMismatchError, match="mlp_moe_gen.down_proj.weight"):
        load_bagel(tmp_path / "ck", progress=False)


def test_position_table_sides_come_from_the_checkpoint_not_config_json(tmp_path):
    import json

    shutil.copytree(ensure_tiny(), tmp_path / "ck")
    top = json.loads((tmp_path / "ck" / "config.json").read_text())
    top["max_latent_size"] = 4  # upstream's loader overrides config.json's value in code; the tables are the truth
    (tmp_path / "ck" / "config.json").write_text(json.dumps(top))
    bagel, _ = load_bagel(tmp_path / "ck", progress=False)
    side = TINY_TOP["max_latent_size"]
    assert bagel.config.max_latent_size == side and bagel.latent_pos_embed.pos_embed.shape[0] == side * side
