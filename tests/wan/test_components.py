"""Each Wan component against its reference on random weights, and the invariants the graph relies on."""

from __future__ import annotations

import pytest
import torch
from mstar_diffusion.schedules import unipc_flow
from mstar_diffusion.solvers import unipc_step
from mstar_wan.config import TextEncoderConfig, TransformerConfig, VAEConfig
from mstar_wan.text_encoder import TextEncoderNode, UMT5Encoder
from mstar_wan.transformer import WanTransformer
from mstar_wan.vae import FrameCache, WanVAE

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

# diffusers' Wan225BPipelineFastTests components
DIT = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=48, out_channels=48,
           text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
           rope_max_seq_len=32)
VAE = dict(base_dim=3, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
           latents_mean=[0.1] * 48, latents_std=[1.5] * 48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
           scale_factor_spatial=16, scale_factor_temporal=4, temperal_downsample=[False, True, True])


def _perturbed(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights away from the initialisation (zero gates and unit norms would hide mistakes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return module.eval()


def test_dit_equals_diffusers_with_per_token_timesteps_and_a_first_frame_condition():
    ref = _perturbed(diffusers.WanTransformer3DModel(**DIT), 0)
    mine = WanTransformer(TransformerConfig(**DIT)).eval()
    mine.load_state_dict(ref.state_dict(), strict=True)
    g = torch.Generator().manual_seed(1)
    x, ctx, cond = torch.randn(2, 48, 3, 4, 4, generator=g), torch.randn(2, 16, 32, generator=g), torch.randn(2, 48, 1, 4, 4, generator=g)
    t = torch.tensor([999.0, 500.0])
    with torch.no_grad():
        want = ref(x, t[:, None].expand(2, 12), ctx, return_dict=False)[0]
        assert (mine(x, t, context=ctx) - want).abs().max() < 1e-5
        # TI2V: frame 0 replaced by the condition, its tokens at t = 0 (the reference's expand_timesteps mask)
        mask = torch.ones(3, 2, 2)
        mask[0] = 0
        want = ref(torch.cat([cond, x[:, :, 1:]], 2), mask.flatten()[None] * t[:, None], ctx, return_dict=False)[0]
        assert (mine(x, t, context=ctx, condition=cond) - want).abs().max() < 1e-5


def test_vae_decode_and_encode_equal_diffusers_and_chunked_decode_equals_whole():
    ref = _perturbed(diffusers.AutoencoderKLWan(**VAE), 2)
    mine = WanVAE(VAEConfig(**VAE)).eval()
    mine.load_state_dict(ref.state_dict(), strict=True)
    g = torch.Generator().manual_seed(3)
    z = torch.randn(1, 48, 4, 2, 2, generator=g)
    mean = torch.tensor(VAE["latents_mean"]).view(1, 48, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(VAE["latents_std"]).view(1, 48, 1, 1, 1)
    with torch.no_grad():
        want = ref.decode(z / inv_std + mean, return_dict=False)[0]
        whole = mine.decode(z)
        assert whole.shape == (1, 3, 13, 32, 32)
        # The 3D VAE sums over ~30 convolutions: fp32 order differs between CPUs by a few 1e-5 (CI saw 1.8e-5)
        assert (whole - want).abs().max() < 1e-4
        cache = FrameCache()
        chunks = [mine.decode_chunk(z[:, :, a:b], a == 0, cache) for a, b in ((0, 1), (1, 3), (3, 4))]
        assert torch.equal(torch.cat(chunks, 2), whole)  # the carried conv cache makes chunking exact
        video = torch.rand(1, 3, 9, 32, 32, generator=g) * 2 - 1
        want = (ref.encode(video).latent_dist.mode() - mean) * inv_std
        assert (mine.encode_mode(video) - want).abs().max() < 1e-4


def test_umt5_encoder_equals_transformers_and_zeroes_past_the_prompt():
    cfg = dict(vocab_size=100, d_model=32, d_kv=8, d_ff=40, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
               relative_attention_max_distance=20)
    ref = _perturbed(transformers.UMT5EncoderModel(transformers.UMT5Config(feed_forward_proj="gated-gelu", **cfg)), 4)
    mine = UMT5Encoder(TextEncoderConfig(**cfg)).eval()
    mine.load_state_dict({k: v for k, v in ref.state_dict().items() if k != "encoder.embed_tokens.weight"}, strict=True)
    ids = torch.randint(0, 100, (2, 30), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, 12:] = 0
    with torch.no_grad():
        want = ref(ids, mask).last_hidden_state
        out = TextEncoderNode(mine, 40).forward_batch([{"input_ids": ids[0]}, {"input_ids": ids[1, :12]}])
    assert (out[0]["context"][:30] - want[0]).abs().max() < 1e-5
    assert (out[1]["context"][:12] - want[1, :12]).abs().max() < 1e-5
    assert out[1]["context"].shape == (40, 32) and not out[1]["context"][12:].any()


@pytest.mark.parametrize(("steps", "shift"), [(1, 3.0), (2, 3.0), (5, 5.0), (12, 5.0)])
def test_unipc_solver_and_schedule_equal_diffusers_bit_for_bit(steps, shift):
    sched = diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                              num_train_timesteps=1000, flow_shift=shift)
    sched.set_timesteps(steps)
    sigmas = unipc_flow(steps, shift)
    assert torch.equal(sched.sigmas, sigmas.float())
    assert torch.equal(sched.timesteps, (sigmas[:-1] * 1000).long())  # integer_timesteps: truncated from float64
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 3, 2, 2, generator=g)
    w = torch.randn(4, 4, generator=g)
    y, history = x.clone(), None
    for i, t in enumerate(sched.timesteps):  # a velocity that depends on x, so the history matters
        x = sched.step(torch.einsum("oc,bcfhw->bofhw", w, x) * 0.3 + x, t, x, return_dict=False)[0]
        y, history = unipc_step(sched.sigmas, i, y, torch.einsum("oc,bcfhw->bofhw", w, y) * 0.3 + y, history)
    assert torch.equal(x, y)


def test_decode_node_batches_requests_at_the_same_chunk_as_if_each_ran_alone():
    from mstar_wan.nodes import DecodeChunkNode

    vae = _perturbed(WanVAE(VAEConfig(**VAE)), 6)
    node = DecodeChunkNode(vae, chunk_frames=2)
    g = torch.Generator().manual_seed(7)
    latents = [torch.randn(48, 3, 2, 2, generator=g) for _ in range(2)]
    with torch.no_grad():
        alone = []
        for z in latents:
            first = node.forward(z, 0)
            alone.append(torch.cat([first["frames"], node.forward(z, 1, vae_cache=first["vae_cache"])["frames"]]))
        both = node.forward_batch([{"latents": z, "chunk": 0, "vae_cache": None} for z in latents])
        both2 = node.forward_batch([{"latents": z, "chunk": 1, "vae_cache": o["vae_cache"]}
                                    for z, o in zip(latents, both, strict=True)])
    for i in range(2):
        video = torch.cat([both[i]["frames"], both2[i]["frames"]])
        assert video.shape == (9, 32, 32, 3)
        assert (video.int() - alone[i].int()).abs().max() <= 1  # uint8 rounding of float sums over another batch
