"""The Thinker's vision encoder (Qwen3-VL style): patches -> ViT blocks -> 2x2 merger, plus deepstack features.

Input: flattened patches `[N, C * temporal_patch * patch * patch]` in spatial-merge-block order (as
`mstar_core.nn.vision_patch` or the Qwen-VL processor lays them out) and `grid_thw` `[images, 3]`.
Learned positions on a square grid are resampled bilinearly (corners aligned) to each image's grid;
attention is 2-D axial RoPE, bidirectional within one frame. After the blocks named in
`deepstack_visual_indexes`, a merger (`merger_list[k]`) turns the patches into features added to the
Thinker's hidden states after decoder layer k. Names are the checkpoint's (`thinker.visual.*`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.nn.mlp import activation
from mstar_core.nn.rotary import apply_rotary
from mstar_qwen_omni.config import VisionConfig


def block_order_positions(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each patch of an `h x w` grid listed block by block (`merge x merge` blocks)."""
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
    return rows.permute(0, 2, 1, 3).reshape(-1), cols.permute(0, 2, 1, 3).reshape(-1)


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps into a `side`-long table for `index` on an axis of `size` (corners aligned)."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = src.floor()
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


class VisionPatchMerger(nn.Module):
    """`merge x merge` neighbouring patches -> one token: LayerNorm (before or after the shuffle) and a 2-layer MLP."""

    def __init__(self, cfg: VisionConfig, postshuffle_norm: bool):
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.ln_q = nn.LayerNorm(self.width if postshuffle_norm else cfg.hidden_size, eps=1e-6)
        self.mlp = nn.ModuleList([nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, cfg.out_hidden_size)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x.reshape(-1, self.width)) if self.postshuffle_norm else self.ln_q(x).reshape(-1, self.width)
        for layer in self.mlp:
            x = layer(x)
        return x


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], segments: list[int]) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).view(t, 3, self.heads, self.head_dim).unbind(1)
        # rotation in fp32, as the reference does for the vision tower
        q, k = (apply_rotary(y.float(), *rope).to(y.dtype) for y in (q, k))
        q, k, v = (y.transpose(0, 1) for y in (q, k, v))
        out = [F.scaled_dot_product_attention(a, b, c) for a, b, c in
               zip(q.split(segments, 1), k.split(segments, 1), v.split(segments, 1), strict=True)]
        return self.proj(torch.cat(out, dim=1).transpose(0, 1).reshape(t, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], segments: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, segments)
        return x + self.mlp(self.norm2(x))


class VisionPatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.shape = (cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        kernel = self.shape[1:]
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = patches.view(-1, *self.shape).to(self.proj.weight.dtype)
        return self.proj(x).view(x.shape[0], -1)


class VisionEncoder(nn.Module):
    """`forward(patches, grid_thw)` -> (merged tokens `[N / merge^2, out]`, deepstack `[N / merge^2, K, out]`)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.patch_embed = VisionPatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.side = int(cfg.num_position_embeddings**0.5)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = VisionPatchMerger(cfg, postshuffle_norm=False)
        self.merger_list = nn.ModuleList(VisionPatchMerger(cfg, postshuffle_norm=True)
                                         for _ in cfg.deepstack_visual_indexes)
        head_dim = cfg.hidden_size // cfg.num_heads
        quarter = head_dim // 2
        steps = torch.arange(0, quarter, 2, dtype=torch.float, device="cpu")
        self.inv_freq = 1.0 / (cfg.rope_theta ** (steps / quarter))  # derived, not a weight

    def _grid_tables(self, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """Per patch: bilinear taps and weights into `pos_embed`, (row, col) for RoPE; and per-frame segments."""
        merge = self.config.spatial_merge_size
        taps, weights, rows, cols, segments = [], [], [], [], []
        for t, h, w in grid_thw.tolist():
            r, c = block_order_positions(h, w, merge)
            ht, hw = _axis_taps(r, h, self.side)
            wt, ww = _axis_taps(c, w, self.side)
            taps.append((ht[:, :, None] * self.side + wt[:, None, :]).reshape(-1, 4).repeat(t, 1))
            weights.append((hw[:, :, None] * ww[:, None, :]).reshape(-1, 4).repeat(t, 1))
            rows.append(r.repeat(t))
            cols.append(c.repeat(t))
            segments += [h * w] * t
        pos = torch.stack([torch.cat(rows), torch.cat(cols)], dim=-1)
        return torch.cat(taps), torch.cat(weights), pos, segments

    def forward(self, patches: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        taps, weights, pos, segments = self._grid_tables(grid_thw.cpu())
        device = self.pos_embed.weight.device
        x = self.patch_embed(patches)
        pos_embed = (self.pos_embed(taps.to(device)) * weights.to(device)[:, :, None]).sum(1)
        x = x + pos_embed.to(x.dtype)
        freqs = pos.to(device).float()[..., None] * self.inv_freq.to(device)  # [N, 2, head_dim / 4]
        half = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([half, half], dim=-1)
        rope = (emb.cos(), emb.sin())
        deep = []
        indexes = list(self.config.deepstack_visual_indexes)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, segments)
            if i in indexes:
                deep.append(self.merger_list[indexes.index(i)](x))
        merged = self.merger(x)
        deepstack = torch.stack(deep, dim=1) if deep else merged.new_zeros(merged.shape[0], 0, merged.shape[1])
        return merged, deepstack
