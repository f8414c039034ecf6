"""SigLIP as a NaViT: images at their own resolution, flattened patches through a linear patch embedding.

The weights are SigLIP's (`embeddings.patch_embedding` as a Linear over a patch flattened in
(row, column, channel) order, `embeddings.position_embedding` looked up by each patch's id in a square
table, the encoder layers and `post_layernorm` of `mstar_core.nn.siglip`). Each image attends within
itself only. A conv patch embedding `[D, C, p, p]` in a checkpoint is converted on load
(`conv_to_linear`).
"""

from __future__ import annotations

import torch
from torch import nn

from mstar_core.nn.norm import LayerNorm
from mstar_core.nn.siglip import SiglipEncoder, SiglipVisionConfig


def conv_to_linear(weight: torch.Tensor) -> torch.Tensor:
    """A conv patch-embedding weight `[D, C, p, p]` as the linear `[D, p*p*C]` over (row, col, channel) patches."""
    return weight.permute(0, 2, 3, 1).reshape(weight.shape[0], -1) if weight.dim() == 4 else weight


def patchify(image: torch.Tensor, patch: int) -> torch.Tensor:
    """`[C, H, W]` (H, W multiples of `patch`) -> `[(H/p)*(W/p), p*p*C]`, patches row-major, each (row, col, channel)."""
    c, h, w = image.shape
    x = image.reshape(c, h // patch, patch, w // patch, patch)
    return torch.einsum("chpwq->hwpqc", x).reshape(-1, patch * patch * c)


class NaViTEmbeddings(nn.Module):
    def __init__(self, cfg: SiglipVisionConfig):
        super().__init__()
        self.patch_embedding = nn.Linear(cfg.num_channels * cfg.patch_size**2, cfg.hidden_size)
        self.position_embedding = nn.Embedding(cfg.num_patches, cfg.hidden_size)

    def forward(self, patches: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(patches.to(self.patch_embedding.weight.dtype))
        return x + self.position_embedding(position_ids.to(x.device))


class SiglipNaViT(nn.Module):
    """Flattened patches `[N, p*p*C]` of one image and their table ids `[N]` -> features `[N, hidden]`."""

    def __init__(self, cfg: SiglipVisionConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = NaViTEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg)
        self.post_layernorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, patches: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(patches, position_ids)[None]
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)[0]
