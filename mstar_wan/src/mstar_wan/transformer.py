"""The Wan2.2 DiT (`WanTransformer3DModel`'s weights, names as in diffusers' `transformer/`).

Video latents `[B, C, F, H, W]` -> 1x2x2 patches (a Conv3d) -> tokens with a 3-D RoPE (head dim split into
time, height and width bands) -> blocks of {self-attention, cross-attention to the UMT5 text, GELU-tanh FFN},
each modulated (shift, scale, gate) by the timestep -> the velocity, unpatchified.

The timestep is per token: every token of a row sees the row's `t`, except the first latent frame when it is an
image condition (TI2V), which sees `t = 0`. Modulation is therefore computed once per distinct timestep (two at
most) and gathered per frame, not once per token.

The blocks are split from the embedding and the head (`embed`, `blocks`, `head`) so a step cache can compare
the first block's modulated input from step to step and skip every block (`mstar_diffusion.step_cache`).
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.nn.timestep import timestep_features
from mstar_wan.config import TransformerConfig


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm computed in float32 (the modulation that follows is float32 too)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else self.weight.float()
        b = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps)


class Linear2(nn.Module):
    """Two linears around an activation; `linear_1` / `linear_2` as diffusers names them."""

    def __init__(self, d_in: int, d_hidden: int, act: nn.Module):
        super().__init__()
        self.linear_1 = nn.Linear(d_in, d_hidden)
        self.act = act
        self.linear_2 = nn.Linear(d_hidden, d_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class ConditionEmbedder(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.freq_dim = cfg.freq_dim
        self.time_embedder = Linear2(cfg.freq_dim, cfg.dim, nn.SiLU())
        self.time_proj = nn.Linear(cfg.dim, 6 * cfg.dim)
        self.text_embedder = Linear2(cfg.text_dim, cfg.dim, nn.GELU(approximate="tanh"))


class Attention(nn.Module):
    """Multi-head attention with q/k RMS-normed across all heads (before the head split)."""

    def __init__(self, dim: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])
        self.norm_q = nn.RMSNorm(dim, eps=eps)
        self.norm_k = nn.RMSNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        kv = x if context is None else context
        q = self.norm_q(self.to_q(x)).unflatten(-1, (self.heads, -1))
        k = self.norm_k(self.to_k(kv)).unflatten(-1, (self.heads, -1))
        v = self.to_v(kv).unflatten(-1, (self.heads, -1))
        if rope is not None:
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.to_out[0](out.transpose(1, 2).flatten(2).type_as(x))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on interleaved pairs (x[2i], x[2i+1]); cos/sin `[L, 1, D/2]`."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)


class FeedForward(nn.Module):
    def __init__(self, dim: int, inner: int):
        super().__init__()
        proj = nn.Module()
        proj.proj = nn.Linear(dim, inner)
        self.net = nn.ModuleList([proj, nn.Identity(), nn.Linear(inner, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](F.gelu(self.net[0].proj(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        dim = cfg.dim
        self.norm1 = FP32LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.attn1 = Attention(dim, cfg.num_attention_heads, cfg.eps)
        self.norm2 = FP32LayerNorm(dim, cfg.eps, elementwise_affine=True)
        self.attn2 = Attention(dim, cfg.num_attention_heads, cfg.eps)
        self.norm3 = FP32LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.ffn = FeedForward(dim, cfg.ffn_dim)
        self.scale_shift_table = nn.Parameter(torch.zeros(1, 6, dim))

    def modulated_input(self, h: torch.Tensor, mod: torch.Tensor) -> torch.Tensor:
        """What self-attention sees: `h` normed, then scaled and shifted by the timestep (as in forward)."""
        shift, scale = (self.scale_shift_table[:, :2] + mod[:, :, :2]).unbind(2)
        return self.norm1(h) * (1 + scale) + shift

    def forward(self, h: torch.Tensor, context: torch.Tensor, mod: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """`mod` `[B, L | 1, 6, dim]` (float32): the per-token (or per-row) time projection."""
        shift, scale, gate, c_shift, c_scale, c_gate = (self.scale_shift_table + mod).unbind(2)
        x = (self.norm1(h) * (1 + scale) + shift).type_as(h)
        h = (h.float() + self.attn1(x, rope=rope) * gate).type_as(h)
        h = h + self.attn2(self.norm2(h).type_as(h), context)
        x = (self.norm3(h) * (1 + c_scale) + c_shift).type_as(h)
        return (h.float() + self.ffn(x).float() * c_gate).type_as(h)


@attrs.frozen
class Tokens:
    """What the blocks need besides the hidden states: one row's text, modulation and rotary tables."""

    context: torch.Tensor  # [B, S, dim]
    mod: torch.Tensor  # [B, L, 6, dim], or [B, 1, 6, dim] when every token has the row's timestep
    temb: torch.Tensor  # [B, L | 1, dim]
    rope: tuple[torch.Tensor, torch.Tensor]
    grid: tuple[int, int, int]

    def select(self, rows: torch.Tensor) -> Tokens:
        """The context of some rows (a step cache runs the later blocks only for rows that changed)."""
        return Tokens(self.context.index_select(0, rows), self.mod.index_select(0, rows),
                      self.temb.index_select(0, rows), self.rope, self.grid)


class WanTransformer(nn.Module):
    """`forward(x [B, C, F, H, W], t [B], /, context [B, S, text_dim], condition=None) -> velocity`.

    `t` is the scheduler's timestep (sigma x 1000, truncated as diffusers' UniPC does). `condition`
    `[B, C, 1, H, W]`: TI2V's first-frame latents; the input's first frame is replaced by it and its
    tokens see t = 0.
    """

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.config = cfg
        dim = cfg.dim
        self.patch_embedding = nn.Conv3d(cfg.in_channels, dim, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.condition_embedder = ConditionEmbedder(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm_out = FP32LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, cfg.out_channels * math.prod(cfg.patch_size))
        self.scale_shift_table = nn.Parameter(torch.zeros(1, 2, dim))
        self._rope_bands: list[torch.Tensor] | None = None  # built on first use (the module may be built on meta)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype its inputs take (its weights'; the modulation tables and time embedding may be float32)."""
        return self.patch_embedding.weight.dtype

    # -- the three stages ---------------------------------------------------------------------------

    def embed(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
              condition: torch.Tensor | None = None) -> tuple[torch.Tensor, Tokens]:
        cfg = self.config
        if condition is not None:  # TI2V: the first latent frame is the image, at t = 0
            x = torch.cat([condition.to(x.dtype), x[:, :, 1:]], dim=2)
        b, _, f, hh, ww = x.shape
        pt, ph, pw = cfg.patch_size
        grid = (f // pt, hh // ph, ww // pw)
        h = self.patch_embedding(x).flatten(2).transpose(1, 2)
        # one embedding per distinct timestep: the row's t, and 0 for a conditioning frame
        first_zero = condition is not None
        ts = torch.stack([t.float(), torch.zeros_like(t, dtype=torch.float32)], 1) if first_zero else t.float()[:, None]
        emb = self.condition_embedder
        temb = emb.time_embedder(timestep_features(ts.reshape(-1), cfg.freq_dim).to(emb.time_embedder.linear_1.weight.dtype))
        temb = temb.type_as(context)
        mod = emb.time_proj(F.silu(temb)).unflatten(-1, (6, -1))
        temb, mod = temb.unflatten(0, (b, -1)), mod.unflatten(0, (b, -1))  # [B, 1|2, ...]
        if first_zero:  # per token: the first frame's tokens take the t = 0 row
            frame_of = torch.arange(grid[0], device=x.device).repeat_interleave(grid[1] * grid[2])
            which = (frame_of == 0).long()
            mod, temb = mod[:, which], temb[:, which]
        # (else one row per request, broadcast over its tokens: never [B, L, 6, dim] for a text-to-video step)
        tokens = Tokens(context=emb.text_embedder(context), mod=mod.float(), temb=temb,
                        rope=self._rope(grid, x.device), grid=grid)
        return h.contiguous(), tokens

    def head(self, h: torch.Tensor, tokens: Tokens) -> torch.Tensor:
        cfg = self.config
        shift, scale = (self.scale_shift_table.unsqueeze(0) + tokens.temb.unsqueeze(2)).unbind(2)
        h = (self.norm_out(h) * (1 + scale) + shift).type_as(h)
        h = self.proj_out(h)
        (f, hh, ww), (pt, ph, pw) = tokens.grid, cfg.patch_size
        h = h.reshape(h.shape[0], f, hh, ww, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return h.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def forward(self, x: torch.Tensor, t: torch.Tensor, /, context: torch.Tensor,
                condition: torch.Tensor | None = None) -> torch.Tensor:
        h, tokens = self.embed(x, t, context, condition)
        for block in self.blocks:
            h = block(h, tokens.context, tokens.mod, tokens.rope)
        return self.head(h, tokens)

    # -- the same forward in stages, for the diffusion engine's step cache (mstar_diffusion.step_cache) --

    def cache_embed(self, x: torch.Tensor, t: torch.Tensor, /, context: torch.Tensor,
                    condition: torch.Tensor | None = None) -> tuple[torch.Tensor, Tokens]:
        return self.embed(x, t, context, condition)

    def cache_indicator(self, h: torch.Tensor, tokens: Tokens, /) -> torch.Tensor:
        """The first block's modulated input (what TeaCache compares from step to step): cheap, no attention."""
        return self.blocks[0].modulated_input(h, tokens.mod)

    def cache_blocks(self, h: torch.Tensor, tokens: Tokens, /) -> torch.Tensor:
        for block in self.blocks:
            h = block(h, tokens.context, tokens.mod, tokens.rope)
        return h

    def cache_head(self, h: torch.Tensor, tokens: Tokens, /) -> torch.Tensor:
        return self.head(h, tokens)

    # -- rotary tables ------------------------------------------------------------------------------

    def _rope(self, grid: tuple[int, int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[L, 1, head_dim/2]`: the time band by frame, then the height and width bands."""
        f, hh, ww = grid
        if self._rope_bands is None:
            self._rope_bands = _rope_bands(self.config.attention_head_dim, self.config.rope_max_seq_len)
        parts = []
        for band, n, shape in zip(self._rope_bands, grid, ((f, 1, 1), (1, hh, 1), (1, 1, ww)), strict=True):
            if n > band.shape[0]:
                raise ValueError(f"wan: a latent grid of {grid} exceeds rope_max_seq_len={band.shape[0]}")
            parts.append(band[:n].reshape(*shape, -1).expand(f, hh, ww, -1))
        angles = torch.cat(parts, dim=-1).reshape(f * hh * ww, 1, -1).to(device)
        return angles.cos().float(), angles.sin().float()


def _rope_bands(head_dim: int, max_len: int) -> list[torch.Tensor]:
    """Angles (float64) per position for the time, height and width bands of the head dim."""
    hw = 2 * (head_dim // 6)
    bands = []
    for dim in (head_dim - 2 * hw, hw, hw):
        inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim))
        bands.append(torch.outer(torch.arange(max_len, dtype=torch.float64), inv))
    return bands
