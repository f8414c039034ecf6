"""BAGEL's weights in the published layout, and the small computations around the LLM.

`Bagel` holds everything `ema.safetensors` holds (`language_model.*`, `vit_model.vision_model.*`,
`connector.*`, `vit_pos_embed.pos_embed`, `time_embedder.*`, `vae2llm`, `llm2vae`,
`latent_pos_embed.pos_embed`); the VAE (`ae.safetensors`) is a separate `FluxAutoEncoder`.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar_bagel.config import BagelConfig
from mstar_core.nn.flux_vae import FluxAutoEncoder
from mstar_core.nn.mlp import MLP
from mstar_core.nn.qwen2_mot import MoTForCausalLM
from mstar_core.nn.siglip_navit import SiglipNaViT, patchify
from mstar_core.nn.sincos import PositionTable, flattened_grid_ids
from mstar_core.nn.timestep import TimestepEmbedder


class Bagel(nn.Module):
    """Every non-VAE weight of a BAGEL checkpoint, under its checkpoint names."""

    def __init__(self, cfg: BagelConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.language_model = MoTForCausalLM(cfg.llm)
        self.vit_model = nn.Module()
        self.vit_model.vision_model = SiglipNaViT(cfg.vit)
        self.connector = MLP(cfg.vit.hidden_size, h, cfg.connector_act, out=h)
        self.vit_pos_embed = PositionTable(cfg.vit_max_num_patch_per_side, h)
        self.time_embedder = TimestepEmbedder(h)
        self.vae2llm = nn.Linear(cfg.patch_latent_dim, h)
        self.llm2vae = nn.Linear(h, cfg.patch_latent_dim)
        self.latent_pos_embed = PositionTable(cfg.max_latent_size, h)

    def vit_ids(self, height: int, width: int) -> torch.Tensor:
        p = self.config.vit.patch_size
        return flattened_grid_ids(height // p, width // p, self.config.vit_max_num_patch_per_side)

    def latent_ids(self, height: int, width: int) -> torch.Tensor:
        d = self.config.latent_downsample
        return flattened_grid_ids(height // d, width // d, self.config.max_latent_size)

    def vit_rows(self, pixels: torch.Tensor) -> torch.Tensor:
        """One image `[3, H, W]` in [-1, 1] (sides multiples of the patch) -> LLM rows `[patches, hidden]`."""
        ids = self.vit_ids(pixels.shape[1], pixels.shape[2]).to(pixels.device)
        features = self.vit_model.vision_model(patchify(pixels, self.config.vit.patch_size), ids)
        return self.connector(features) + self.vit_pos_embed(ids).to(features.dtype)

    def latent_rows(self, tokens: torch.Tensor, t: torch.Tensor | float, ids: torch.Tensor) -> torch.Tensor:
        """Patchified latents `[n, p*p*z]` at flow time `t` with their grid ids -> LLM rows `[n, hidden]`."""
        dtype = self.vae2llm.weight.dtype
        t = torch.as_tensor(t, dtype=torch.float32, device=tokens.device).reshape(1)
        return (self.vae2llm(tokens.to(dtype)) + self.time_embedder(t).to(dtype)
                + self.latent_pos_embed(ids).to(dtype))

    def velocity(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.llm2vae(hidden)


def latent_tokens(vae: FluxAutoEncoder, pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """One image `[3, H, W]` in [-1, 1] -> its VAE latents patchified `[(h/p)*(w/p), p*p*z]`."""
    return patchify(vae.encode(pixels[None])[0], patch)


def tokens_to_image(vae: FluxAutoEncoder, tokens: torch.Tensor, rows: int, cols: int, patch: int) -> torch.Tensor:
    """Patchified latents `[rows*cols, p*p*z]` -> an RGB image `[H, W, 3]` uint8."""
    z = vae.config.z_channels
    latent = tokens.reshape(rows, cols, patch, patch, z)
    latent = torch.einsum("hwpqc->chpwq", latent).reshape(z, rows * patch, cols * patch)
    pixels = vae.decode(latent[None])[0].float()
    return ((pixels * 0.5 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).contiguous()
