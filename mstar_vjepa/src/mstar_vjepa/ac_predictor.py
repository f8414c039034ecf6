"""The V-JEPA 2-AC predictor (upstream `VisionTransformerPredictorAC`), frame-causal, on packed tokens.

Tokens per time step are `[a_t, s_t, patches_t]`. Every token of step t attends to all tokens of steps <= t
(a frame-causal block mask), so a step's keys and values depend only on earlier steps: processing one new step
against cached keys/values of earlier ones is exact. Parameter names follow the upstream checkpoint (fused qkv).

The blocks run on packed rows `[T, dim]` and reach the cache only through `context.attend(layer, q, k, v,
scale)`, the `kvcache` engine's attention contract: the same weights serve upstream's batch API
(`ACPredictor.forward`, over a dense frame cache) and the `kvcache` engine (`PagedACPredictor`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar_vjepa.config import ACPredictorConfig
from mstar_vjepa.encoder import Mlp
from mstar_vjepa.kv import DenseFrameCache
from mstar_vjepa.rope import apply_rotation, rotation_tables

COND_TOKENS = 2  # action and state tokens lead each time step


class ACAttention(nn.Module):
    """Fused-qkv attention; patch tokens get 3-D RoPE, action/state tokens are rotated on the time axis only."""

    def __init__(self, dim: int, heads: int, qkv_bias: bool = True):
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layer: int, context) -> torch.Tensor:
        """x `[T, dim]`; rope = cos/sin tables `[T, 1, head_dim]`."""
        t, dim = x.shape
        qkv = self.qkv(x).view(t, 3, self.heads, self.head_dim)
        q, k = apply_rotation(qkv[:, 0], *rope), apply_rotation(qkv[:, 1], *rope)
        return self.proj(context.attend(layer, q, k, qkv[:, 2], self.head_dim**-0.5).reshape(t, dim))


class ACBlock(nn.Module):
    """Pre-norm block with ACAttention and a GELU MLP."""

    def __init__(self, cfg: ACPredictorConfig):
        super().__init__()
        dim = cfg.predictor_embed_dim
        self.norm1 = nn.LayerNorm(dim, eps=cfg.layer_norm_eps)
        self.attn = ACAttention(dim, cfg.num_heads, cfg.qkv_bias)
        self.norm2 = nn.LayerNorm(dim, eps=cfg.layer_norm_eps)
        self.mlp = Mlp(dim, int(dim * cfg.mlp_ratio))

    def forward(self, x, rope, layer, context):
        x = x + self.attn(self.norm1(x), rope, layer, context)
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

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.tokens_per_frame + COND_TOKENS

    def new_cache(self, batch: int, device=None, dtype: torch.dtype | None = None) -> DenseFrameCache:
        """An empty frame cache sized for the full frame-causal window."""
        cfg, p = self.cfg, self.predictor_embed.weight
        return DenseFrameCache(cfg.depth, batch, cfg.num_heads, cfg.predictor_embed_dim // cfg.num_heads,
                               self.tokens_per_step, cfg.max_frames, dtype or p.dtype, device or p.device)

    def embed_frames(self, latents: torch.Tensor, actions: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """Latents `[..., n, P, embed]`, actions/states `[..., n, 7]` -> step tokens `[..., n * (2 + P), dim]`."""
        dtype = self.predictor_embed.weight.dtype  # (requests and pose maths give fp32; a bf16 model embeds in bf16)
        x = torch.cat([self.action_encoder(actions.to(dtype)).unsqueeze(-2), self.state_encoder(states.to(dtype)).unsqueeze(-2),
                       self.predictor_embed(latents.to(dtype))], dim=-2)
        return x.flatten(-3, -2)

    def frame_positions(self, first: int, n: int, device=None) -> torch.Tensor:
        """RoPE positions `[3, n * (2 + P)]` (time, row, col) of steps first..first+n-1.

        Action/state tokens sit at row = col = 0: a rotation by 0 is the identity, so they turn on time only.
        """
        g, p = self.cfg.grid_size, self.cfg.tokens_per_frame
        ids = torch.arange(p, device=device)
        zeros = torch.zeros(COND_TOKENS, dtype=torch.long, device=device)
        row, col = torch.cat([zeros, ids // g]), torch.cat([zeros, ids % g])
        time = torch.arange(first, first + n, device=device).repeat_interleave(p + COND_TOKENS)
        return torch.stack([time, row.repeat(n), col.repeat(n)])

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[T, 1, head_dim]` for positions `[3, T]`, shared by every layer."""
        cos, sin = rotation_tables(self.cfg.predictor_embed_dim // self.cfg.num_heads, *positions, dtype)
        return cos[:, None], sin[:, None]

    def run(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], context) -> torch.Tensor:
        """Packed step tokens `[T, dim]` through every block -> hidden `[T, dim]`."""
        for i, block in enumerate(self.predictor_blocks):
            x = block(x, rope, i, context)
        return x

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden rows `[..., dim]` -> predicted latents `[..., embed]`."""
        return self.predictor_proj(self.predictor_norm(hidden))

    def forward(self, latents: torch.Tensor, actions: torch.Tensor, states: torch.Tensor,
                cache: DenseFrameCache | None = None) -> torch.Tensor:
        """Process n new frames after those in `cache` (None: a fresh, discarded cache = upstream's full pass)."""
        b, n, p, _ = latents.shape
        if p != self.cfg.tokens_per_frame:
            raise ValueError(f"expected {self.cfg.tokens_per_frame} patch tokens per frame, got {p}")
        if cache is None:
            cache = self.new_cache(b, latents.device, latents.dtype)
        start = cache.num_frames
        if start + n > self.cfg.max_frames:
            raise ValueError(f"history of {start + n} frames exceeds the {self.cfg.max_frames}-step frame-causal mask")
        x = self.embed_frames(latents, actions, states).flatten(0, 1)  # [B * n * (2 + P), dim]
        cos, sin = self.rope(self.frame_positions(start, n, x.device), x.dtype)
        x = self.run(x, (cos.repeat(b, 1, 1), sin.repeat(b, 1, 1)), cache)
        cache.commit(n)
        return self.head(x.view(b, n, p + COND_TOKENS, -1)[:, :, COND_TOKENS:])


class PagedACPredictor(nn.Module):
    """The AC predictor as a `kvcache` node (same weights as `predictor`, which keeps upstream's batch API).

    Inputs per call: step tokens as `input_embeds` `[T, dim]` (`ACPredictor.embed_frames`) and their positions
    `[3, T]` (`frame_positions`); the node's `frame_size` option gives the frame-causal mask. Output
    `latent`: the predictions of the returned rows, layer-normed as each rollout step's next latent.
    """

    position_axes = 3

    def __init__(self, predictor: ACPredictor):
        super().__init__()
        self.predictor = predictor

    def kv_cache_spec(self) -> tuple[int, int, int, None, int]:
        cfg = self.predictor.cfg
        return cfg.depth, cfg.num_heads, cfg.predictor_embed_dim // cfg.num_heads, None, cfg.predictor_embed_dim

    def forward(self, input_ids, positions, context, *, input_embeds=None) -> torch.Tensor:
        return self.predictor.run(input_embeds, self.predictor.rope(positions, input_embeds.dtype), context)

    def compute_latent(self, hidden: torch.Tensor) -> torch.Tensor:
        z = self.predictor.head(hidden)
        return F.layer_norm(z, (z.shape[-1],))
