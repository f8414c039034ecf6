"""The V-JEPA 2-AC predictor (upstream `VisionTransformerPredictorAC`), frame-causal, with an optional KV cache.

Tokens per time step are `[a_t, s_t, patches_t]`. Every token of step t attends to all tokens of steps <= t
(a frame-causal block mask), so a step's keys and values depend only on earlier steps: processing one new step
against cached keys/values of earlier ones is exact. Parameter names follow the upstream checkpoint (fused qkv).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar_vjepa.config import ACPredictorConfig
from mstar_vjepa.encoder import Mlp
from mstar_vjepa.kv import DenseFrameCache, FrameCache
from mstar_vjepa.rope import apply_rotation, rotation_tables

COND_TOKENS = 2  # action and state tokens lead each time step


def frame_causal_mask(new_frames: int, cached_frames: int, tokens_per_frame: int, device=None) -> torch.Tensor:
    """Bool mask `[new, cached + new]` (True = may attend): cached frames fully visible, new ones block-causal."""
    q_frame = torch.arange(new_frames, device=device).repeat_interleave(tokens_per_frame) + cached_frames
    k_frame = torch.arange(cached_frames + new_frames, device=device).repeat_interleave(tokens_per_frame)
    return k_frame.unsqueeze(0) <= q_frame.unsqueeze(1)


class ACAttention(nn.Module):
    """Fused-qkv attention; patch tokens get 3-D RoPE, action/state tokens are rotated on the time axis only."""

    def __init__(self, dim: int, heads: int, qkv_bias: bool = True):
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layer: int, cache: FrameCache,
                mask) -> torch.Tensor:
        """x `[B, n, 2+P, dim]` for n new frames; rope = cos/sin tables `[n, 2+P, head_dim]`."""
        b, n, tpf, dim = x.shape
        qkv = self.qkv(x).view(b, n, tpf, 3, self.heads, self.head_dim).permute(3, 0, 4, 1, 2, 5)
        q, k = apply_rotation(qkv[0], *rope), apply_rotation(qkv[1], *rope)
        q, k, v = (t.reshape(b, self.heads, n * tpf, self.head_dim) for t in (q, k, qkv[2]))
        k, v = cache.extend(layer, k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5)
        return self.proj(out.transpose(1, 2).reshape(b, n, tpf, dim))


class ACBlock(nn.Module):
    """Pre-norm block with ACAttention and a GELU MLP."""

    def __init__(self, cfg: ACPredictorConfig):
        super().__init__()
        dim = cfg.predictor_embed_dim
        self.norm1 = nn.LayerNorm(dim, eps=cfg.layer_norm_eps)
        self.attn = ACAttention(dim, cfg.num_heads, cfg.qkv_bias)
        self.norm2 = nn.LayerNorm(dim, eps=cfg.layer_norm_eps)
        self.mlp = Mlp(dim, int(dim * cfg.mlp_ratio))

    def forward(self, x, rope, layer, cache, mask):
        x = x + self.attn(self.norm1(x), rope, layer, cache, mask)
        return x + self.mlp(self.norm2(x))


class ACPredictor(nn.Module):
    """Latents `[B, n, P, embed]`, actions and states `[B, n, 7]` -> predicted next latents `[B, n, P, embed]`."""

    def __init__(self, cfg: ACPredictorConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.predictor_embed_dim
        self.predictor_embed = nn.Linear(cfg.embed_dim, d)
        self.action_encoder = nn.Linear(cfg.action_embed_dim, d)
        self.state_encoder = nn.Linear(cfg.action_embed_dim, d)
        self.predictor_blocks = nn.ModuleList(ACBlock(cfg) for _ in range(cfg.depth))
        self.predictor_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.predictor_proj = nn.Linear(d, cfg.embed_dim)

    def new_cache(self, batch: int, device=None, dtype: torch.dtype | None = None) -> DenseFrameCache:
        """An empty frame cache sized for the full frame-causal window."""
        cfg = self.cfg
        p = self.predictor_embed.weight
        return DenseFrameCache(
            cfg.depth, batch, cfg.num_heads, cfg.predictor_embed_dim // cfg.num_heads,
            cfg.tokens_per_frame + COND_TOKENS, cfg.max_frames, dtype or p.dtype, device or p.device,
        )

    def rope_tables(self, start: int, n: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[n, 2+P, head_dim]`: action/state tokens rotate on time only, patches on (time, row, col)."""
        cfg, p = self.cfg, self.cfg.tokens_per_frame
        hd = cfg.predictor_embed_dim // cfg.num_heads
        frames = torch.arange(start, start + n, device=device)
        ids = torch.arange(p, device=device)
        cond = rotation_tables(hd, frames[:, None].expand(n, COND_TOKENS), None, None, dtype)
        patches = rotation_tables(hd, frames[:, None].expand(n, p), (ids // cfg.grid_size).expand(n, p),
                                  (ids % cfg.grid_size).expand(n, p), dtype)
        return torch.cat([cond[0], patches[0]], 1), torch.cat([cond[1], patches[1]], 1)

    def forward(
        self, latents: torch.Tensor, actions: torch.Tensor, states: torch.Tensor, cache: FrameCache | None = None
    ) -> torch.Tensor:
        """Process n new frames after those in `cache` (None: a fresh, discarded cache = upstream's full pass)."""
        b, n, p, _ = latents.shape
        if p != self.cfg.tokens_per_frame:
            raise ValueError(f"expected {self.cfg.tokens_per_frame} patch tokens per frame, got {p}")
        if cache is None:
            cache = self.new_cache(b, latents.device, latents.dtype)
        start = cache.num_frames
        if start + n > self.cfg.max_frames:
            raise ValueError(f"history of {start + n} frames exceeds the {self.cfg.max_frames}-step frame-causal mask")
        x = self.predictor_embed(latents)
        a = self.action_encoder(actions).unsqueeze(2)
        s = self.state_encoder(states).unsqueeze(2)
        x = torch.cat([a, s, x], dim=2)  # [B, n, 2+P, D]
        rope = self.rope_tables(start, n, x.dtype, x.device)
        # a single new frame sees everything cached plus itself: no mask needed
        mask = None if n == 1 else frame_causal_mask(n, start, p + COND_TOKENS, x.device)
        for i, block in enumerate(self.predictor_blocks):
            x = block(x, rope, i, cache, mask)
        cache.commit(n)
        return self.predictor_proj(self.predictor_norm(x[:, :, COND_TOKENS:]))
