"""The dense frame cache behind `ACPredictor.forward` (upstream's batch API; the reference for the paged engine).

With a frame-causal mask, a frame's keys and values never change once computed, so a rollout step only
projects the new frame's tokens and attends over the cache. `fork(n)` gives n sequences that share this
cache's frames by reference (the parent is never written after a fork); `copy(n)` materialises them.
Served rollouts keep their frames in the `kvcache` engine's paged pool instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def frame_causal_mask(new_frames: int, cached_frames: int, tokens_per_frame: int, device=None) -> torch.Tensor:
    """Bool mask `[new, cached + new]` (True = may attend): cached frames fully visible, new ones block-causal."""
    q_frame = torch.arange(new_frames, device=device).repeat_interleave(tokens_per_frame) + cached_frames
    k_frame = torch.arange(cached_frames + new_frames, device=device).repeat_interleave(tokens_per_frame)
    return k_frame.unsqueeze(0) <= q_frame.unsqueeze(1)


class DenseFrameCache:
    """Per-layer buffers `[B, H, capacity, D]` of B equally long sequences, optionally behind a shared prefix."""

    def __init__(self, num_layers: int, batch: int, heads: int, head_dim: int, tokens_per_frame: int,
                 max_frames: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 prefix: DenseFrameCache | None = None):
        if prefix is not None and prefix.batch not in (1, batch):
            raise ValueError(f"a prefix of batch {prefix.batch} cannot be shared by {batch} sequences")
        self.batch, self.tokens_per_frame, self.max_frames, self.prefix = batch, tokens_per_frame, max_frames, prefix
        self.prefix_frames = prefix.num_frames if prefix is not None else 0
        self._shape = (num_layers, heads, head_dim, dtype, torch.device(device))
        own = (max_frames - self.prefix_frames) * tokens_per_frame
        self.k = [torch.empty(batch, heads, own, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(batch, heads, own, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.own_frames = 0
        self._mask = None

    @property
    def num_frames(self) -> int:
        return self.prefix_frames + self.own_frames

    def layer_kv(self, layer: int, frames: int, extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of the first `frames` frames of `layer` (prefix included), plus `extra` own tokens."""
        own = (frames - self.prefix_frames) * self.tokens_per_frame + extra
        k, v = self.k[layer][:, :, :own], self.v[layer][:, :, :own]
        if self.prefix is None or self.prefix_frames == 0:
            return k, v
        pk, pv = (t.expand(self.batch, -1, -1, -1) for t in self.prefix.layer_kv(layer, self.prefix_frames))
        return torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new k/v `[B, H, n, D]` for `layer`; return the layer's full k/v including them."""
        start, n = self.own_frames * self.tokens_per_frame, k.shape[2]
        if start + n > self.k[layer].shape[2]:
            raise ValueError(f"frame cache full: at most {self.max_frames} frames fit the frame-causal mask")
        self.k[layer][:, :, start : start + n] = k
        self.v[layer][:, :, start : start + n] = v
        return self.layer_kv(layer, self.num_frames, n)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """The attention context: packed rows `[B * N, H, D]` (N new tokens per sequence) -> `[B * N, H, D]`."""
        b, heads, dim = self.batch, q.shape[1], q.shape[2]
        q, k, v = (t.view(b, -1, heads, dim).transpose(1, 2) for t in (q, k, v))
        if layer == 0:  # one new frame sees everything: no mask
            new = q.shape[2] // self.tokens_per_frame
            self._mask = None if new == 1 else frame_causal_mask(new, self.num_frames, self.tokens_per_frame, q.device)
        k, v = self.extend(layer, k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self._mask, scale=scale)
        return out.transpose(1, 2).reshape(-1, heads, dim)

    def commit(self, frames: int) -> None:
        """Mark `frames` more frames as cached (after every layer has been extended)."""
        self.own_frames += frames

    def fork(self, n: int) -> DenseFrameCache:
        """n sequences continuing from this cache; its frames are shared, not copied."""
        layers, heads, head_dim, dtype, device = self._shape
        return DenseFrameCache(layers, n, heads, head_dim, self.tokens_per_frame, self.max_frames, dtype, device, self)

    def copy(self, n: int) -> DenseFrameCache:
        """n sequences continuing from this cache, each with its own copy of its frames."""
        layers, heads, head_dim, dtype, device = self._shape
        out = DenseFrameCache(layers, n, heads, head_dim, self.tokens_per_frame, self.max_frames, dtype, device)
        for layer in range(layers):
            k, v = self.layer_kv(layer, self.num_frames)
            out.extend(layer, k.expand(n, -1, -1, -1).clone(), v.expand(n, -1, -1, -1).clone())
        out.commit(self.num_frames)
        return out

    def nbytes(self) -> int:
        """Memory this cache owns (a forked prefix is counted by its owner)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
