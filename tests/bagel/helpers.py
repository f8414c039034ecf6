"""The upstream-style dense BAGEL pipeline (`mstar_bagel.reference`) run on a request's prepared env.

Shared by the invariant tests (M*'s latents must equal it) and benchmarks/bagel_cfg.py (its baseline side).
"""

from __future__ import annotations

import torch

from mstar_bagel import reference


def dense_latents(loaded, env: dict, seed: int) -> tuple[dict, torch.Tensor]:
    """(the three dense labels' caches, the latents) of one request from its own prepared env."""
    bagel, vae, ids = loaded.extras["bagel"], loaded.extras["vae"], loaded.extras["special_ids"]
    prompt = env["prompt_ids"].tolist()
    if env["walk"] == "edit":
        labels = reference.edit_labels(bagel, vae, env["vae_pixels"], env["vit_pixels"], prompt, ids.boi, ids.eoi)
    else:
        labels = reference.t2i_labels(bagel, prompt)
    rows, cols = env["latent_grid"]
    latents = reference.generate(bagel, labels, ids.boi, ids.eoi, rows, cols, num_steps=env["num_steps"],
                                 shift=env["shift"], seed=seed, text_scale=env["guidance_scale"],
                                 img_scale=env["image_guidance_scale"], interval=env["cfg_interval"],
                                 renorm=env["cfg_renorm"], floor=env["cfg_renorm_min"])
    return labels, latents
