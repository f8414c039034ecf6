"""BAGEL's text-producing walks served equal the dense reference: `understand` (images, then the prompt, greedy
decode) and `think` (a greedy thought into `main`; the image over the three labels only if the thought opens one
with <|vision_start|>, else the text alone).

With random weights the thought's choice is arbitrary, so each branch is forced by a `logit_bias` on <|vision_start|>
(259) or <|im_end|> (258), the same bias added in the reference; the values were read off the tiny preset, whose
text ends by itself (a red fox: <|im_end|> after one token; with -100 on 258, +0.4 on 259 -> three tokens, then the
image opens; with -100 on 258 alone the thought runs on). The reference never picks the ids past the tokenizer (the tiny vocabulary is padded to 1024
rows), as the engine never samples them.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from mstar_bagel.nodes import GenLLM, VAEDecodeNode

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


def _never(loaded) -> dict[int, float]:
    """-inf on every id no token stands for: the reference's greedy pick skips them, as the engine's does."""
    return {t: float("-inf") for t in loaded.extras["grammar_vocab"].no_token_ids}


def _think_labels(loaded, prep):
    """The reference's three labels after a think request's system prompt and prompt."""
    bagel = loaded.extras["bagel"]
    main = reference.Label()
    reference.prefill_text(bagel, main, prep["system_ids"].tolist())
    cfg_text = main.copy()
    reference.prefill_text(bagel, main, prep["prompt_ids"].tolist())
    return {"main": main, "cfg_text": cfg_text, "cfg_img": main.copy()}


@pytest.fixture
def calls(monkeypatch):
    """Counts of the flow's velocity heads (llm_gen) and VAE decodes the served requests run."""
    seen = {"velocity": 0, "decode": 0}

    def counted(name, fn):
        def wrapper(*args, **kw):
            seen[name] += 1
            return fn(*args, **kw)
        return wrapper

    monkeypatch.setattr(GenLLM, "compute_velocity", counted("velocity", GenLLM.compute_velocity))
    monkeypatch.setattr(VAEDecodeNode, "forward", counted("decode", VAEDecodeNode.forward))
    return seen


def test_understand_and_think_equal_dense_greedy_reference(calls):
    und = {"task": "understand", "max_tokens": 6,
           "content": ["first", _image(0, 30, 44), "then", _image(1, 60, 28), "what is in the pictures?"]}
    think = {"task": "think", "prompt": "a red fox", "max_tokens": 8, "num_steps": 3, "seed": 4,
             "logit_bias": {"258": -100, "259": 0.4}}
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
    want = reference.decode_greedy(bagel, main, [ids.bos], 6, (ids.eos,), _never(loaded))
    assert [env_u["first_token"], *env_u["decoded"]] == want

    prep = loaded.prepare_inputs(think)
    labels = _think_labels(loaded, prep)
    thought = reference.decode_greedy(bagel, labels["main"], [ids.bos], 8, (ids.eos, ids.boi),
                                      {**_never(loaded), ids.eos: -100, ids.boi: 0.4})
    assert len(thought) > 1 and thought[-1] == ids.boi  # a real thought, then the model opens an image
    assert [env_t["first_token"], *env_t["decoded"]] == thought and env_t["finish_reason"] == "stop"
    reference.prefill_text(bagel, labels["main"], [ids.eos])  # the opening <|vision_start|> is never fed; <|im_end|> closes
    rows, cols = prep["latent_grid"]
    latents = reference.generate(bagel, labels, ids.boi, ids.eoi, rows, cols, num_steps=3, shift=prep["shift"], seed=4,
                                 text_scale=prep["guidance_scale"], img_scale=prep["image_guidance_scale"],
                                 interval=prep["cfg_interval"], renorm=prep["cfg_renorm"], floor=0.0)
    assert (env_t["latents"][0] - latents).abs().max() < 1e-5
    assert env_t["image"][0].shape[:2] == (rows * loaded.extras["config"].latent_downsample, cols * loaded.extras["config"].latent_downsample)
    assert calls["velocity"] > 0 and calls["decode"] == 1  # (the counters the text-only test reads do count)


@pytest.mark.parametrize(("extra", "bias", "finish"), [
    ({"max_tokens": 8}, None, "stop"),  # ends on <|im_end|> (by itself: the preset's text ends)
    ({"max_tokens": 5, "logit_bias": {"258": -100}}, {258: -100}, "length"),  # runs out before opening an image
])
def test_think_that_opens_no_image_ends_with_the_text(calls, extra, bias, finish):
    req = {"task": "think", "prompt": "a red fox", "num_steps": 3, "seed": 4, **extra}
    loaded, (env,), pages_left = _serve([req])
    assert pages_left == 0
    assert calls == {"velocity": 0, "decode": 0}  # no flow step, no VAE decode
    assert "image" not in env and "latents" not in env
    ids, tok = loaded.extras["special_ids"], loaded.extras["tokenizer"]
    labels = _think_labels(loaded, loaded.prepare_inputs(req))
    thought = reference.decode_greedy(loaded.extras["bagel"], labels["main"], [ids.bos], req["max_tokens"],
                                      (ids.eos, ids.boi), {**_never(loaded), **(bias or {})})
    assert ids.boi not in thought
    assert [env["first_token"], *env["decoded"]] == thought and env["finish_reason"] == finish
    assert env["text"] == tok.decode(thought, skip_special_tokens=True)


def test_think_with_an_image_edits_after_the_thought():
    # +100 on <|vision_start|>: the very first sample opens the image (an empty thought; the decode loop never runs)
    req = {"task": "think", "prompt": "make it blue", "image": _image(3, 36, 52), "max_tokens": 4, "num_steps": 2,
           "seed": 2, "logit_bias": {"259": 100}}
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
    thought = reference.decode_greedy(bagel, main, [ids.bos], 4, (ids.eos, ids.boi), {**_never(loaded), ids.boi: 100})
    assert thought == [ids.boi] and [env["first_token"], *env["decoded"]] == thought
    reference.prefill_text(bagel, main, [ids.eos])
    rows, cols = prep["latent_grid"]
    latents = reference.generate(bagel, {"main": main, "cfg_text": cfg_text, "cfg_img": cfg_img}, ids.boi, ids.eoi,
                                 rows, cols, num_steps=2, shift=prep["shift"], seed=2, text_scale=4.0, img_scale=2.0,
                                 interval=(0.0, 1.0), renorm="text_channel")
    assert (env["latents"][0] - latents).abs().max() < 1e-5
    down = loaded.extras["config"].latent_downsample
    assert tuple(prep["vae_pixels"].shape[1:]) == (rows * down, cols * down)  # drawn on the VAE grid
    assert env["image"][0].shape[:2] == (36, 52)  # answered at the input's size
