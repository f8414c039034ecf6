"""The served walks against diffusers' pipelines on the tiny preset (diffusers' own fast-test config).

Tolerance: the frames equal the reference's `output_type="pt"` frames rounded to uint8 within one level (our
walk returns uint8 video; the float difference before rounding is ~1e-6), and the t2v latents within 1e-4.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from mstar_wan.checkpoint import ensure_tiny

from mstar_core.errors import RequestError
from mstar_core.model import LoadOptions
from mstar_core.runtime import AsyncEngine

diffusers = pytest.importorskip("diffusers")

PROMPT, STEPS, GUIDANCE = "a cat sitting on a mat", 2, 6.0
IMAGE = torch.randint(0, 256, (32, 32, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def served():
    """One engine: a t2v and an i2v request at once (their CFG rows share forwards), then one alone."""

    async def go():
        async with AsyncEngine() as engine:
            loaded = await engine.load_model("wan", LoadOptions(preset="tiny"))
            reqs = [{"prompt": PROMPT, "seed": 7}, {"prompt": PROMPT, "seed": 3, "image": IMAGE},
                    {"prompt": "a dog", "seed": 8}]
            envs = await asyncio.gather(*(engine.generate("wan", r) for r in reqs))
            stats = dict(engine.node_engines("wan")["denoise"].stats())
            return loaded, envs, stats

    return asyncio.run(go())


@pytest.fixture(scope="module")
def pipe():
    return diffusers.WanPipeline.from_pretrained(str(ensure_tiny()))


def _frames(out: torch.Tensor) -> torch.Tensor:
    return (out.permute(0, 2, 3, 1) * 255).round()


def test_t2v_equals_wan_pipeline(served, pipe):
    _, (env, _, _), _ = served
    kw = dict(negative_prompt="", height=32, width=32, num_frames=9, num_inference_steps=STEPS,
              guidance_scale=GUIDANCE, max_sequence_length=16)
    latents = pipe(PROMPT, generator=torch.Generator().manual_seed(7), output_type="latent", **kw).frames
    assert (env["latents"] - latents[0]).abs().max() < 1e-4
    video = pipe(PROMPT, generator=torch.Generator().manual_seed(7), output_type="pt", **kw).frames[0]
    assert env["video"].shape == (9, 32, 32, 3) and env["video"].dtype == torch.uint8
    assert (env["video"].float() - _frames(video)).abs().max() <= 1
    assert env["seed"] == 7


def test_i2v_equals_wan_image_to_video_pipeline(served, pipe):
    from PIL import Image

    _, (_, env, _), _ = served
    i2v = diffusers.WanImageToVideoPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae,
                                            scheduler=pipe.scheduler, transformer=pipe.transformer, image_encoder=None,
                                            image_processor=None, expand_timesteps=True)
    # diffusers 0.42.1's i2v prompt cleaning needs ftfy; the embeddings come from the t2v pipeline's encoder instead
    cond, uncond = pipe.encode_prompt(prompt=PROMPT, negative_prompt="", max_sequence_length=16,
                                      do_classifier_free_guidance=True)
    video = i2v(image=Image.fromarray(IMAGE.numpy()), prompt_embeds=cond, negative_prompt_embeds=uncond, height=32,
                width=32, num_frames=9, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                generator=torch.Generator().manual_seed(3), output_type="pt").frames[0]
    assert (env["video"].float() - _frames(video)).abs().max() <= 1


def test_cfg_rows_of_both_requests_share_each_dit_forward(served):
    _, _, stats = served
    # 3 requests x 2 steps x (cond, uncond) rows; a request's two rows always share a forward (never one row alone),
    # and the two t2v requests' rows meet when their steps coincide (the i2v rows carry a condition: their own forward)
    assert stats["diffusion_rows_total"] == 12
    assert stats["diffusion_forwards"] <= 6
    assert stats["diffusion_max_rows"] in (2, 4)


def test_decode_streams_chunk_by_chunk(served):
    loaded, (env, _, _), _ = served
    assert loaded.extras["defaults"].decode_chunk_frames == 2
    assert [c.shape[0] for c in env["video_chunks"]] == [5, 4]  # latent frames (0, 1) -> 1 + 4, then (2) -> 4
    assert torch.equal(torch.cat(env["video_chunks"]), env["video"])


@pytest.mark.parametrize(("field", "value"), [("num_frames", 10), ("height", 48), ("width", 0), ("num_steps", 0),
                                              ("guidance_scale", -1), ("image", b"not an image"), ("prompt", None)])
def test_bad_fields_are_request_errors_naming_the_field(served, field, value):
    loaded, _, _ = served
    with pytest.raises(RequestError) as info:
        loaded.prepare_inputs({"prompt": "x", field: value})
    assert info.value.param == field


def test_bf16_weights_stay_within_bf16_noise_of_the_bf16_pipeline(pipe):
    """bf16 with the references' float32 islands (time embedding, modulation tables, norms; UMT5's `wo`).

    Tolerance: 0.15 on latents of mean magnitude ~1 (each side's bf16 run is ~0.06 from the float32 one)."""

    async def go():
        async with AsyncEngine() as engine:
            await engine.load_model("wan", LoadOptions(preset="tiny", dtype="bfloat16"))
            return await engine.generate("wan", {"prompt": "a cat", "seed": 1})

    env = asyncio.run(go())
    bf16 = diffusers.WanPipeline.from_pretrained(str(ensure_tiny()), torch_dtype=torch.bfloat16)
    kw = dict(negative_prompt="", height=32, width=32, num_frames=9, num_inference_steps=2, guidance_scale=6.0,
              max_sequence_length=16, output_type="latent")
    want = bf16("a cat", generator=torch.Generator().manual_seed(1), **kw).frames[0].float()
    assert (env["latents"] - want).abs().max() < 0.15
    exact = pipe("a cat", generator=torch.Generator().manual_seed(1), **kw).frames[0]
    assert 0 < (env["latents"] - exact).abs().max() < 0.15  # bf16 for real, and close
