"""BAGEL's blocks against implementations nobody here wrote, with the tiny preset's weights.

LLM (understanding expert) vs transformers' Qwen3 with attention_bias; FLUX VAE vs diffusers' AutoencoderKL;
the NaViT SigLIP vs transformers' SigLIP vision model on a square image; the flow schedule vs diffusers'
FlowMatchEulerDiscreteScheduler(shift=3).
"""

from __future__ import annotations

import re

import pytest
import torch
from mstar_bagel.checkpoint import ensure_tiny, load_bagel
from mstar_diffusion.schedules import flow_euler

from mstar_core.nn import DenseAttention
from mstar_core.nn.siglip_navit import patchify

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny():
    return load_bagel(ensure_tiny(), progress=False)


def _und_state(bagel) -> dict[str, torch.Tensor]:
    """The understanding expert's weights under HF Qwen3 names (o_proj bias zero: BAGEL's o_proj has none)."""
    out = {}
    for name, t in bagel.language_model.state_dict().items():
        if "_moe_gen" in name:
            continue
        out[name] = t
        if name.endswith("o_proj.weight"):
            out[name.replace("weight", "bias")] = torch.zeros(t.shape[0])
    return out


def test_llm_text_forward_equals_qwen3_with_attention_bias(tiny):
    bagel, _ = tiny
    c = bagel.config.llm
    hf_cfg = transformers.Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope["rope_theta"], attention_bias=True, tie_word_embeddings=False,
        max_position_embeddings=c.max_position_embeddings)
    hf = transformers.Qwen3ForCausalLM(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict(_und_state(bagel), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    ids = torch.randint(0, c.vocab_size, (1, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids).logits[0]
        lm = bagel.language_model
        got = lm.compute_logits(lm(ids[0], torch.arange(23), DenseAttention()))
    assert (got - want).abs().max() < 1e-4
    assert want.abs().max() > 0.1  # not a trivially small output


def _diffusers_name(name: str, levels: int) -> str:
    name = re.sub(r"^encoder\.down\.(\d+)\.block\.(\d+)\.", r"encoder.down_blocks.\1.resnets.\2.", name)
    name = re.sub(r"^encoder\.down\.(\d+)\.downsample\.", r"encoder.down_blocks.\1.downsamplers.0.", name)
    name = re.sub(r"^decoder\.up\.(\d+)\.",
                  lambda m: f"decoder.up.{levels - 1 - int(m.group(1))}.", name)
    name = re.sub(r"^decoder\.up\.(\d+)\.block\.(\d+)\.", r"decoder.up_blocks.\1.resnets.\2.", name)
    name = re.sub(r"^decoder\.up\.(\d+)\.upsample\.", r"decoder.up_blocks.\1.upsamplers.0.", name)
    name = re.sub(r"\.mid\.block_(\d)\.", lambda m: f".mid_block.resnets.{int(m.group(1)) - 1}.", name)
    name = name.replace(".mid.attn_1.norm.", ".mid_block.attentions.0.group_norm.")
    for ours, theirs in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("proj_out", "to_out.0")):
        name = name.replace(f".mid.attn_1.{ours}.", f".mid_block.attentions.0.{theirs}.")
    name = name.replace(".nin_shortcut.", ".conv_shortcut.").replace(".norm_out.", ".conv_norm_out.")
    return name


def test_vae_equals_diffusers_autoencoderkl(tiny):
    diffusers = pytest.importorskip("diffusers")
    _, vae = tiny
    c = vae.config
    levels = len(c.ch_mult)
    hf = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * levels,
        up_block_types=["UpDecoderBlock2D"] * levels, block_out_channels=[c.ch * m for m in c.ch_mult],
        layers_per_block=c.num_res_blocks, latent_channels=c.z_channels, norm_num_groups=c.norm_groups,
        use_quant_conv=False, use_post_quant_conv=False, scaling_factor=c.scale_factor, shift_factor=c.shift_factor,
    ).eval()
    state = {}
    for name, t in vae.state_dict().items():
        target = _diffusers_name(name, levels)
        state[target] = t.reshape(t.shape[0], t.shape[1]) if "attentions.0.to_" in target and t.dim() == 4 else t
    hf.load_state_dict(state, strict=True)
    g = torch.Generator().manual_seed(1)
    pixels = torch.rand(1, 3, 16, 24, generator=g) * 2 - 1
    with torch.no_grad():
        mean = hf.encode(pixels).latent_dist.mean
        got = vae.encode(pixels) / c.scale_factor + c.shift_factor
        assert (got - mean).abs().max() < 1e-4
        z = torch.randn(1, c.z_channels, 8, 12, generator=g)
        want = hf.decode(z).sample
        assert (vae.decoder(z) - want).abs().max() < 1e-4
        assert (vae.decode(z * c.scale_factor - c.scale_factor * c.shift_factor) - want).abs().max() < 1e-4


def test_vit_equals_transformers_siglip_on_a_square_image(tiny):
    bagel, _ = tiny
    c = bagel.config.vit
    hf_cfg = transformers.SiglipVisionConfig(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, image_size=c.image_size, patch_size=c.patch_size,
        layer_norm_eps=c.layer_norm_eps, hidden_act=c.hidden_act, vision_use_head=False)
    hf = transformers.SiglipVisionModel(hf_cfg).eval()
    state = {}
    for name, t in bagel.vit_model.vision_model.state_dict().items():
        if name == "embeddings.patch_embedding.weight":  # (row, col, channel) linear -> conv
            t = t.reshape(t.shape[0], c.patch_size, c.patch_size, c.num_channels).permute(0, 3, 1, 2)
        state[name] = t
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("position_ids" in m for m in missing), (missing, unexpected)
    pixels = torch.rand(3, c.image_size, c.image_size, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with torch.no_grad():
        want = hf(pixel_values=pixels[None]).last_hidden_state[0]
        ids = bagel.vit_ids(c.image_size, c.image_size)
        got = bagel.vit_model.vision_model(patchify(pixels, c.patch_size), ids)
    assert (got - want).abs().max() < 1e-4


def test_flow_schedule_equals_diffusers_flow_match_euler_shift3():
    diffusers = pytest.importorskip("diffusers")
    steps = 49
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    # BAGEL's grid: 50 uniform points from 1 to 0; diffusers shifts the given sigmas and appends the terminal 0
    scheduler.set_timesteps(sigmas=torch.linspace(1.0, 0.0, steps + 1)[:-1].numpy())
    ours = flow_euler(steps, 3.0)
    assert torch.allclose(scheduler.sigmas.double(), ours, atol=1e-6)
    # and the Euler updates walk the same path
    g = torch.Generator().manual_seed(3)
    x_theirs = x_ours = torch.randn(4, 8, generator=g)
    table = ours.float()
    for i, t in enumerate(scheduler.timesteps):
        v = torch.sin(x_ours * (i + 1))
        x_theirs = scheduler.step(v, t, x_theirs).prev_sample
        x_ours = x_ours + (table[i + 1] - table[i]) * v
    assert (x_theirs - x_ours).abs().max() < 1e-5
