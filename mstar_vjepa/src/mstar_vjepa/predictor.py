"""The V-JEPA 2 masked predictor: context latents + mask tokens at target positions -> predicted latents.

Parameter names follow HF's `predictor.*` layout. Attention is bidirectional and RoPE carries each token's
original position, so tokens need no sorting: the result is permutation-equivariant.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar_vjepa.config import VJEPA2Config
from mstar_vjepa.encoder import RopeBlock, VJEPA2Encoder
from mstar_vjepa.rope import grid_positions


def gather_tokens(x: torch.Tensor, masks: list[torch.Tensor]) -> torch.Tensor:
    """Select token indices `[B, K]` from `x [B, N, D]` for each mask; masks stack along the batch."""
    return torch.cat([torch.gather(x, 1, m.to(x.device).unsqueeze(-1).expand(-1, -1, x.shape[-1])) for m in masks])


class _PredictorEmbeddings(nn.Module):
    def __init__(self, cfg: VJEPA2Config):
        super().__init__()
        self.predictor_embeddings = nn.Linear(cfg.hidden_size, cfg.pred_hidden_size)
        self.mask_tokens = nn.Parameter(torch.zeros(cfg.pred_num_mask_tokens, 1, 1, cfg.pred_hidden_size))


class VJEPA2Predictor(nn.Module):
    """Predict latents at `target_masks` positions from encoder latents at `context_masks` positions."""

    # HF's predictor embeds targets with mask token #1 (mask_index defaults to 1).
    mask_index = 1

    def __init__(self, cfg: VJEPA2Config):
        super().__init__()
        self.cfg = cfg
        self.embeddings = _PredictorEmbeddings(cfg)
        self.layer = nn.ModuleList(
            RopeBlock(cfg.pred_hidden_size, cfg.pred_num_attention_heads, cfg.pred_mlp_ratio, cfg.layer_norm_eps, cfg.qkv_bias)
            for _ in range(cfg.pred_num_hidden_layers)
        )
        self.layernorm = nn.LayerNorm(cfg.pred_hidden_size, eps=cfg.layer_norm_eps)
        self.proj = nn.Linear(cfg.pred_hidden_size, cfg.hidden_size)

    def forward(
        self, latents: torch.Tensor, context_masks: list[torch.Tensor], target_masks: list[torch.Tensor]
    ) -> torch.Tensor:
        """latents `[B, N, hidden]`, masks lists of `[B, K]` index tensors -> `[B * len(masks), K_target, hidden]`."""
        if len(context_masks) != len(target_masks):
            raise ValueError("context_masks and target_masks must have the same number of masks")
        ctx = self.embeddings.predictor_embeddings(gather_tokens(latents, context_masks))
        tm = torch.cat(target_masks).to(latents.device)
        cm = torch.cat(context_masks).to(latents.device)
        token = self.embeddings.mask_tokens[self.mask_index % self.cfg.pred_num_mask_tokens].to(ctx.dtype)
        target = token.expand(tm.shape[0], tm.shape[1], -1)
        x = torch.cat([ctx, target], dim=1)
        ids = torch.cat([cm, tm], dim=1)
        pos = grid_positions(ids, self.cfg.grid_size, self.cfg.grid_size)
        for block in self.layer:
            x = block(x, pos)
        x = self.layernorm(x)
        return self.proj(x[:, ctx.shape[1] :])


class VJEPA2Model(nn.Module):
    """Encoder + masked predictor under the HF top-level names (`encoder.*`, `predictor.*`)."""

    def __init__(self, cfg: VJEPA2Config):
        super().__init__()
        self.cfg = cfg
        self.encoder = VJEPA2Encoder(cfg)
        self.predictor = VJEPA2Predictor(cfg)

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        return self.encoder(video)

    def predict(
        self,
        latents: torch.Tensor,
        context_masks: list[torch.Tensor] | None = None,
        target_masks: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Masked prediction; default masks cover every token (HF's default)."""
        if context_masks is None and target_masks is None:
            full = torch.arange(latents.shape[1], device=latents.device).expand(latents.shape[0], -1)
            context_masks, target_masks = [full], [full]
        if context_masks is None or target_masks is None:
            raise ValueError("pass both context_masks and target_masks, or neither (full coverage)")
        return self.predictor(latents, context_masks, target_masks)

