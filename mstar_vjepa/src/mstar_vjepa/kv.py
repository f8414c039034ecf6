"""The dense frame cache behind `ACPredictor.forward` (upstream's batch API; the reference for the paged engine).

With a frame-causal mask, a frame's keys and values never change once computed, so a rollout step only
projects the new frame's tokens and attends over the cache; `copy(n)` continues n sequences from it.
Served rollouts keep their frames in the `kvcache` engine's paged pool instead (forks share pages there).
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
    """Per-layer buffers `[B, H, capacity, D]` of B equally long sequences."""

    def __init__(self, num_layers: int, batch: int, heads: int, head_dim: int, tokens_per_frame: int,
                 max_frames: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.batch, self.tokens_per_frame, self.max_frames = batch, tokens_per_frame, max_frames
        self._shape = (num_layers, heads, head_dim, dtype, torch.device(device))
        size = max_frames * tokens_per_frame
        self.k = [torch.empty(batch, heads, size, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(batch, heads, size, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_frames = 0
        self._mask = None

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new k/v `[B, H, n, D]` for `layer`; return the layer's full k/v including them."""
        start, n = self.num_frames * self.tokens_per_frame, k.shape[2]
        if start + n > self.k[layer].shape[2]:
            raise ValueError(f"frame cache full: at most {self.max_frames} frames fit the frame-causal mask")
        self.k[layer][:, :, start : start + n] = k
        self.v[layer][:, :, start : start + n] = v
        return self.k[layer][:, :, : start + n], self.v[layer][:, :, : start + n]

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
        self.num_frames += frames

    def copy(self, n: int) -> DenseFrameCache:
        """n sequences continuing from this cache (of batch 1), each with its own copy of its frames."""
        layers, heads, head_dim, dtype, device = self._shape
        out = DenseFrameCache(layers, n, heads, head_dim, self.tokens_per_frame, self.max_frames, dtype, device)
        used = self.num_frames * self.tokens_per_frame
        for layer in range(layers):
            out.extend(layer, *(t[layer][:, :, :used].expand(n, -1, -1, -1) for t in (self.k, self.v)))
        out.commit(self.num_frames)
        return out
