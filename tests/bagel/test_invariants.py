"""BAGEL served on the shared engines equals the dense upstream-style baseline, and frees every page.

M* keeps three cache labels per request (forks sharing pages), runs each flow step's CFG branches as
read-only calls batched into one forward; the baseline deep-copies each label's cache and runs each
branch as its own forward over [cached K/V; latents]. Same weights, same noise: same latents.
"""

from __future__ import annotations

import asyncio

import torch

from mstar_bagel import reference
from mstar_core.model import LoadOptions
from mstar_core.nn import DenseAttention
from mstar_core.runtime import AsyncEngine
from tests.bagel.helpers import dense_latents

TOL = 1e-5


async def _idle(eng, tries=200):
    for _ in range(tries):
        if not eng.active_requests():
            return
        await asyncio.sleep(0.02)


def _serve(requests, during=None, settings=None):
    async def go():
        async with AsyncEngine() as engine:
            loaded = await engine.load_model("bagel", LoadOptions(preset="tiny"), settings=settings)
            engines = engine.node_engines("bagel")
            handles = [engine.submit("bagel", r) for r in requests]
            seen = await during(engine, handles) if during else None
            envs = await asyncio.gather(*(h.result() for h in handles), return_exceptions=True)
            await _idle(engines["llm"])
            await _idle(engines["llm_gen"])
            return loaded, engines, envs, seen

    return asyncio.run(go())


def _ids(loaded):
    return loaded.extras["special_ids"]


def _image(seed=0, h=40, w=52):
    return torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_t2i_label_forks_and_read_only_steps_equal_dense_baseline():
    req = {"task": "t2i", "prompt": "a red fox in the snow", "num_steps": 6, "seed": 5}
    loaded, engines, (env,), _ = _serve([req])
    prepared = loaded.prepare_inputs(req)
    _, want = dense_latents(loaded, prepared, req["seed"])
    assert (env["latents"][0] - want).abs().max() < TOL
    rows, cols = prepared["latent_grid"]
    image = reference.decode(loaded.extras["vae"], want, rows, cols, loaded.extras["config"].latent_patch_size)
    assert (env["image"][0].int() - image.int()).abs().max() <= 1
    # t2i defaults: text CFG only inside (0.4, 1]: two branches at the first steps, one at the last
    assert engines["llm_gen"].largest_batch == 2
    assert engines["llm"].pool.num_used == 0 and not engines["llm"].active_requests()


def test_edit_three_branches_batched_equal_three_separate_dense_forwards():
    req = {"task": "edit", "prompt": "make it blue", "image": _image(), "num_steps": 4, "seed": 7}
    loaded, engines, (env,), _ = _serve([req])
    prepared = loaded.prepare_inputs(req)
    _, want = dense_latents(loaded, prepared, req["seed"])
    assert (env["latents"][0] - want).abs().max() < TOL
    down = loaded.extras["config"].latent_downsample
    assert [v * down for v in prepared["latent_grid"]] == [512, 656]  # drawn after BAGEL's VAE resize (short side 512)
    assert env["image"][0].shape == (40, 52, 3)  # answered at the input's size
    gen = engines["llm_gen"]
    assert gen.largest_batch == 3 and gen.num_steps == 4  # main, cfg_text, cfg_img: one forward per step


def test_read_only_flow_step_equals_dense_recompute_over_context_and_latents():
    """A step over the frozen text cache equals one dense pass over [text; BOI, latents, EOI] with BAGEL's mask."""
    from mstar_core.runtime import AsyncEngine

    async def load():
        async with AsyncEngine() as engine:
            return await engine.load_model("bagel", LoadOptions(preset="tiny"))

    loaded = asyncio.run(load())
    bagel, ids = loaded.extras["bagel"], _ids(loaded)
    lm = bagel.language_model
    prompt = [ids.bos, 5, 77, 300 % 256, ids.eos]
    g = torch.Generator().manual_seed(3)
    rows_in = bagel.latent_rows(torch.randn(16, bagel.config.patch_latent_dim, generator=g), torch.tensor(0.7),
                                torch.arange(16))
    with torch.inference_mode():
        label = reference.Label()
        reference.prefill_text(bagel, label, prompt)
        cached = reference.branch_velocity(bagel, label, ids.boi, ids.eoi, rows_in)
        n_text, n = len(prompt), 18
        x = torch.cat([lm.embed(torch.tensor(prompt)), lm.embed(torch.tensor([ids.boi])), rows_in,
                       lm.embed(torch.tensor([ids.eoi]))])
        mask = torch.ones(n_text + n, n_text + n, dtype=torch.bool).tril()
        mask[n_text:, :] = True  # the latent block sees the text and all of itself
        positions = torch.cat([torch.arange(n_text), torch.full((n,), n_text)])
        routing = torch.tensor([0] * n_text + [0] + [1] * 16 + [0])
        dense = bagel.velocity(lm(None, positions, DenseAttention(mask=mask), input_embeds=x, routing=routing)[n_text + 1:-1])
    assert (cached - dense).abs().max() < TOL


def test_eight_concurrent_t2i_each_equal_alone():
    reqs = [{"task": "t2i", "prompt": f"prompt number {i}" + "!" * i, "num_steps": 3, "seed": 100 + i,
             "width": 16 + 16 * (i % 3), "height": 32} for i in range(8)]
    # every flow admitted at once (the default runs one request's flow at a time)
    _, engines, together, _ = _serve(reqs, settings={"llm_gen": {"max_active_requests": 8}})
    assert engines["llm_gen"].largest_batch > 2  # several requests' branches shared forwards
    for req, env in zip(reqs, together, strict=True):
        _, _, (alone,), _ = _serve([req])
        assert (env["latents"][0] - alone["latents"][0]).abs().max() < TOL
        assert torch.equal(env["image"][0], alone["image"][0])


def test_flows_run_one_request_at_a_time_oldest_first_by_default():
    """llm_gen admits one request's flow at a time, oldest first: the first request is done before the last starts."""
    reqs = [{"task": "t2i", "prompt": f"prompt {i}", "num_steps": 3, "seed": i, "width": 16, "height": 16}
            for i in range(3)]

    async def during(engine, handles):
        done = []

        async def one(i, h):
            await h.result()
            done.append(i)

        await asyncio.gather(*(one(i, h) for i, h in enumerate(handles)))
        return done

    _, engines, envs, done = _serve(reqs, during)
    assert done == [0, 1, 2]
    assert engines["llm_gen"].largest_batch == 2  # one request's two CFG branches (t2i: text scale 4, image 1)
    assert all(not isinstance(env, BaseException) for env in envs)


def test_every_page_is_free_after_normal_end_error_and_cancellation():
    ok = {"task": "edit", "prompt": "make it blue", "image": _image(1), "num_steps": 30, "seed": 1}

    async def during(engine, handles):
        # cancel the second request mid-flow (its labels are written, the loop is running)
        gen = engine.node_engines("bagel")["llm_gen"]
        for _ in range(2000):
            if gen.num_steps >= 3:
                break
            await asyncio.sleep(0.005)
        used = gen.pool.num_used
        handles[1].cancel()
        return used

    loaded, engines, envs, used_at_cancel = _serve([dict(ok, num_steps=3), ok], during=during)
    assert isinstance(envs[0], dict) and "cancelled" in str(envs[1])
    assert used_at_cancel  # the cancelled request held pages mid-flow
    pool = engines["llm"].pool
    assert pool.num_used == 0 and not engines["llm"].active_requests() and not engines["llm_gen"].active_requests()

    async def failing():
        async with AsyncEngine() as engine:
            loaded = await engine.load_model("bagel", LoadOptions(preset="tiny"))
            env = loaded.prepare_inputs(dict(ok, num_steps=3))
            env["gen_position_table"] = env["gen_position_table"][:, :3]  # wrong length: the first step fails
            handle = engine.submit("bagel", env, prepared=True)
            try:
                await handle.result()
            except Exception as exc:
                error = exc
            eng = engine.node_engines("bagel")["llm"]
            await _idle(eng)
            return error, eng

    error, eng = asyncio.run(failing())
    assert "positions" in str(error)
    assert eng.pool.num_used == 0 and not eng.active_requests()


def test_n_images_share_the_prompt_labels_and_equal_single_requests_seeded_apart():
    req = {"task": "t2i", "prompt": "three foxes", "num_steps": 2, "seed": 20, "n": 3, "width": 16, "height": 16}
    _, engines, (env,), _ = _serve([req])
    assert len(env["image"]) == 3 and env["seeds"] == [20, 21, 22]
    assert engines["llm"].num_steps == 1  # one prefill of the prompt for all three images
    assert engines["llm_gen"].largest_batch == 6  # three images x two CFG branches in one forward
    for i in range(3):
        _, _, (alone,), _ = _serve([dict(req, n=1, seed=20 + i)])
        assert (env["latents"][i] - alone["latents"][0]).abs().max() < TOL


def test_think_cancelled_mid_thought_frees_its_pages():
    # <|im_end|> (258) held off: the preset's thoughts end by themselves within a few tokens; this one must not
    req = {"task": "think", "prompt": "a fox", "max_tokens": 400, "num_steps": 2, "seed": 0,
           "logit_bias": {"258": -100}}

    async def during(engine, handles):
        llm = engine.node_engines("bagel")["llm"]
        for _ in range(4000):
            if llm.num_steps >= 12:  # system, prompt, then ten thought tokens
                break
            await asyncio.sleep(0.002)
        used = llm.pool.num_used
        handles[0].cancel()
        return used

    _, engines, (env,), used = _serve([req], during=during)
    assert "cancelled" in str(env) and used > 0
    assert engines["llm"].pool.num_used == 0 and not engines["llm"].active_requests()
