"""V-JEPA's rotary embedding: head_dim split into depth/height/width thirds, each rotated by its own position.

V-JEPA pairs adjacent channels (2i, 2i+1) but indexes the frequency table by `j mod D/2` for channel j (the
table is tiled, not interleaved). Upstream keeps this quirk for checkpoint compatibility, so we reproduce it.
"""

from __future__ import annotations

import torch


def rotate(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotate `x [..., N, D]` by positions `pos` (broadcastable to `[..., N]`)."""
    half = x.shape[-1] // 2
    omega = torch.arange(half, dtype=x.dtype, device=x.device) / half
    omega = 1.0 / 10000**omega
    angle = pos.to(x.dtype).unsqueeze(-1) * omega
    cos = torch.cat([angle.cos(), angle.cos()], dim=-1)
    sin = torch.cat([angle.sin(), angle.sin()], dim=-1)
    pairs = x.unflatten(-1, (half, 2))
    swapped = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return x * cos + swapped * sin


def axis_dim(head_dim: int) -> int:
    """Channels rotated per axis: the largest even number <= head_dim / 3."""
    return 2 * ((head_dim // 3) // 2)


def rotate_3d(x: torch.Tensor, frame: torch.Tensor, row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """Rotate depth, height and width thirds of `x [..., N, D]`; leftover channels pass through."""
    d = axis_dim(x.shape[-1])
    parts = [
        rotate(x[..., :d], frame),
        rotate(x[..., d : 2 * d], row),
        rotate(x[..., 2 * d : 3 * d], col),
    ]
    if 3 * d < x.shape[-1]:
        parts.append(x[..., 3 * d :])
    return torch.cat(parts, dim=-1)


def grid_positions(ids: torch.Tensor, grid_h: int, grid_w: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split flat token ids (frame-major, then row, then column) into (frame, row, col)."""
    per_frame = grid_h * grid_w
    frame = ids // per_frame
    rest = ids - frame * per_frame
    row = rest // grid_w
    return frame, row, rest - row * grid_w


def _tiled(pos: torch.Tensor, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    half = dim // 2
    omega = 1.0 / 10000 ** (torch.arange(half, dtype=dtype, device=pos.device) / half)
    angle = pos.to(dtype).unsqueeze(-1) * omega
    return torch.cat([angle.cos(), angle.cos()], -1), torch.cat([angle.sin(), angle.sin()], -1)


def rotation_tables(
    head_dim: int, frame: torch.Tensor, row: torch.Tensor | None, col: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[..., head_dim]` equal to `rotate_3d` (time axis only when row/col are None).

    Built once per forward and shared by every layer; unrotated channels get cos 1, sin 0.
    """
    d = axis_dim(head_dim)
    parts = [_tiled(frame, d, dtype)]
    if row is not None and col is not None:
        parts += [_tiled(row, d, dtype), _tiled(col, d, dtype)]
    used = d * len(parts)
    if used < head_dim:
        ones = torch.ones(*frame.shape, head_dim - used, dtype=dtype, device=frame.device)
        parts.append((ones, torch.zeros_like(ones)))
    return torch.cat([c for c, _ in parts], -1), torch.cat([s for _, s in parts], -1)


def apply_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs of `x [..., D]` with precomputed tables (see `rotation_tables`)."""
    pairs = x.unflatten(-1, (-1, 2))
    swapped = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return x * cos + swapped * sin
