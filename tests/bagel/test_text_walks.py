"""BAGEL's text-producing walks served equal the dense reference: `understand` (images, then the prompt, greedy
decode) and `think` (a greedy thought into `main`, then the image over the three labels)."""

from __future__ import annotations

import asyncio

import torch

from mstar_bagel import reference
from mstar_core.model import LoadOptions
from mstar_core.runtime import AsyncEngine


def _serve(requests):
    async def go():
        async with AsyncEngine() as engine:
            loaded = await engine.load_model("bagel", LoadOptions(preset="tiny"))
            envs = await asyncio.gather(*(engine.submit("bagel", r).result() for r in requests))
            return loaded, envs, engine.node_engines("bagel")["llm"].pool.num_used

    return asyncio.run(go())


def _image(seed, h, w):
    return torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_understand_and_think_equal_dense_greedy_reference():
    und = {"task": "understand", "max_tokens": 6,
           "content": ["first", _image(0, 30, 44), "then", _image(1, 60, 28), "what is in the pictures?"]}
    think = {"task": "think", "prompt": "a red fox", "max_tokens": 5, "num_steps": 3, "seed": 4}
    loaded, (env_u, env_t), pages_left = _serve([und, think])
    assert pages_left == 0
    bagel, ids = loaded.extras["bagel"], loaded.extras["special_ids"]

    prep = loaded.prepare_inputs(und)
    main = reference.Label()
    tok = loaded.extras["tokenizer"]
    pixels = iter([p["vit_pixels"] for p in prep["parts"] if "vit_pixels" in p])  # resized as served
    for item in und["content"]:  # in order: text blocks causal, images as bidirectional ViT blocks
        if isinstance(item, str):
            reference.prefill_text(bagel, main, [ids.bos, *tok.encode(item, add_special_tokens=False).ids, ids.eos])
        else:
            reference.prefill_block(bagel, main, ids.boi, ids.eoi, bagel.vit_rows(next(pixels)), gen=False)
    want = reference.decode_greedy(bagel, main, [ids.bos], 6, (ids.eos,))
    assert [env_u["first_token"], *env_u["decoded"]] == want

    prep = loaded.prepare_inputs(think)
    main = reference.Label()
    reference.prefill_text(bagel, main, prep["system_ids"].tolist())
    cfg_text = main.copy()
    reference.prefill_text(bagel, main, prep["prompt_ids"].tolist())
    cfg_img = main.copy()
    thought = reference.decode_greedy(bagel, main, [ids.bos], 5, (ids.eos, ids.boi))
    assert [env_t["first_token"], *env_t["decoded"]] == thought
    reference.prefill_text(bagel, main, [ids.eos])  # the thought's last sampled token is never fed; <|im_end|> closes it
    rows, cols = prep["latent_grid"]
    labels = {"main": main, "cfg_text": cfg_text, "cfg_img": cfg_img}
    latents = reference.generate(bagel, labels, ids.boi, ids.eoi, rows, cols, num_steps=3, shift=prep["shift"], seed=4,
                                 text_scale=prep["guidance_scale"], img_scale=prep["image_guidance_scale"],
                                 interval=prep["cfg_interval"], renorm=prep["cfg_renorm"], floor=0.0)
    assert (env_t["latents"][0] - latents).abs().max() < 1e-5


def test_think_with_an_image_edits_after_the_thought():
    req = {"task": "think", "prompt": "make it blue", "image": _image(3, 36, 52), "max_tokens": 4, "num_steps": 2,
           "seed": 2}
    loaded, (env,), pages_left = _serve([req])
    assert pages_left == 0
    bagel, vae, ids = loaded.extras["bagel"], loaded.extras["vae"], loaded.extras["special_ids"]
    prep = loaded.prepare_inputs(req)
    assert prep["walk"] == "think_edit"
    main = reference.Label()
    reference.prefill_text(bagel, main, prep["system_ids"].tolist())
    cfg_img = main.copy()
    tokens = bagel.latent_rows(reference.latent_tokens(vae, prep["vae_pixels"], bagel.config.latent_patch_size), 0.0,
                               bagel.latent_ids(*prep["vae_pixels"].shape[1:]))
    reference.prefill_block(bagel, main, ids.boi, ids.eoi, tokens, gen=True)
    reference.prefill_block(bagel, main, ids.boi, ids.eoi, bagel.vit_rows(prep["vit_pixels"]), gen=False)
    cfg_text = main.copy()
    reference.prefill_text(bagel, main, prep["prompt_ids"].tolist())
    reference.prefill_text(bagel, cfg_img, prep["prompt_ids"].tolist())
    thought = reference.decode_greedy(bagel, main, [ids.bos], 4, (ids.eos, ids.boi))
    assert [env["first_token"], *env["decoded"]] == thought
    reference.prefill_text(bagel, main, [ids.eos])
    rows, cols = prep["latent_grid"]
    latents = reference.generate(bagel, {"main": main, "cfg_text": cfg_text, "cfg_img": cfg_img}, ids.boi, ids.eoi,
                                 rows, cols, num_steps=2, shift=prep["shift"], seed=2, text_scale=4.0, img_scale=2.0,
                                 interval=(0.0, 1.0), renorm="text_channel")
    assert (env["latents"][0] - latents).abs().max() < 1e-5
    assert env["image"][0].shape[:2] == (rows * 4, cols * 4)
