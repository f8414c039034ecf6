"""Frame KV caches for the AC predictor: per-layer keys/values of frames already processed.

With a frame-causal mask, a frame's keys and values never change once computed, so a rollout step only
projects the new frame's tokens and attends over the cache. `fork(n)` gives n sequences that share this
cache's frames by reference (nothing is copied: the parent is never written after a fork, which is the
copy-on-write contract of a paged pool); `copy(n)` materialises them, as the reference for tests.
"""

from __future__ import annotations

from typing import Protocol

import torch


class FrameCache(Protocol):
    """What the AC predictor needs from a cache; swap in a paged-pool-backed one without touching the model."""

    batch: int
    num_frames: int

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new k/v `[B, H, n, D]` for `layer`; return the layer's full k/v including them."""
        ...

    def commit(self, frames: int) -> None:
        """Mark `frames` more frames as cached (after every layer has been extended)."""
        ...


class DenseFrameCache:
    """Preallocated per-layer buffers `[B, H, capacity, D]`, optionally behind a shared (forked) prefix."""

    def __init__(
        self,
        num_layers: int,
        batch: int,
        heads: int,
        head_dim: int,
        tokens_per_frame: int,
        max_frames: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        prefix: DenseFrameCache | None = None,
    ):
        if prefix is not None and prefix.batch not in (1, batch):
            raise ValueError(f"a prefix of batch {prefix.batch} cannot be shared by {batch} sequences")
        self.batch = batch
        self.tokens_per_frame = tokens_per_frame
        self.max_frames = max_frames
        self.prefix = prefix
        self.prefix_frames = prefix.num_frames if prefix is not None else 0
        self._shape = (num_layers, heads, head_dim, dtype, torch.device(device))
        own = (max_frames - self.prefix_frames) * tokens_per_frame
        self.k = [torch.empty(batch, heads, own, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(batch, heads, own, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.own_frames = 0

    @property
    def num_frames(self) -> int:
        return self.prefix_frames + self.own_frames

    def _prefix_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.prefix is None or self.prefix_frames == 0:
            return None
        k, v = self.prefix.layer_kv(layer, self.prefix_frames)
        return k.expand(self.batch, -1, -1, -1), v.expand(self.batch, -1, -1, -1)

    def layer_kv(self, layer: int, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of the first `frames` frames of `layer` (prefix included)."""
        own = (frames - self.prefix_frames) * self.tokens_per_frame
        k, v = self.k[layer][:, :, :own], self.v[layer][:, :, :own]
        pre = self._prefix_kv(layer)
        if pre is None:
            return k, v
        return torch.cat([pre[0], k], dim=2), torch.cat([pre[1], v], dim=2)

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = k.shape[2]
        start = self.own_frames * self.tokens_per_frame
        if start + n > self.k[layer].shape[2]:
            raise ValueError(f"frame cache full: at most {self.max_frames} frames fit the frame-causal mask")
        self.k[layer][:, :, start : start + n] = k
        self.v[layer][:, :, start : start + n] = v
        own_k, own_v = self.k[layer][:, :, : start + n], self.v[layer][:, :, : start + n]
        pre = self._prefix_kv(layer)
        if pre is None:
            return own_k, own_v
        return torch.cat([pre[0], own_k], dim=2), torch.cat([pre[1], own_v], dim=2)

    def commit(self, frames: int) -> None:
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
