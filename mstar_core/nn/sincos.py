"""Fixed sine-cosine position tables (MAE-style 2-D grids: BAGEL's `vit_pos_embed` and `latent_pos_embed`)."""

from __future__ import annotations

import torch


def sincos_1d(dim: int, positions: torch.Tensor) -> torch.Tensor:
    """`[N]` positions -> `[N, dim]`: sines then cosines of positions times 1/10000^(2i/dim), computed in float64."""
    if dim % 2:
        raise ValueError(f"a sin-cos table needs an even width, got {dim}")
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0))
    angles = positions.to(torch.float64).reshape(-1)[:, None] * omega[None]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def _check_width(dim: int) -> None:
    if dim % 4:
        raise ValueError(f"a 2-D sin-cos table needs a width divisible by 4, got {dim}")


def sincos_2d(dim: int, grid_size: int) -> torch.Tensor:
    """`[grid_size**2, dim]` float32, row-major over (row, col): the first half encodes the column, the second the row.

    (The MAE table's order: its meshgrid puts the column coordinate first.)
    """
    _check_width(dim)
    coords = torch.arange(grid_size, dtype=torch.float64)
    h = coords[:, None].expand(grid_size, grid_size).reshape(-1)
    w = coords[None, :].expand(grid_size, grid_size).reshape(-1)
    return torch.cat([sincos_1d(dim // 2, w), sincos_1d(dim // 2, h)], dim=1).float()


def flattened_grid_ids(rows: int, cols: int, max_per_side: int) -> torch.Tensor:
    """Ids of a `rows x cols` patch grid in a `max_per_side`-wide table (extrapolation: the top-left corner)."""
    if rows > max_per_side or cols > max_per_side:
        raise ValueError(f"a {rows}x{cols} patch grid exceeds the table's {max_per_side} patches per side")
    return (torch.arange(rows)[:, None] * max_per_side + torch.arange(cols)[None, :]).reshape(-1)


class PositionTable(torch.nn.Module):
    """A fixed 2-D sin-cos table stored as parameter `pos_embed` (the checkpoint keeps it), looked up by id."""

    def __init__(self, grid_size: int, dim: int):
        super().__init__()
        if torch.get_default_device().type == "meta":  # built to load a checkpoint into: nothing to compute
            _check_width(dim)
            table = torch.empty(grid_size * grid_size, dim)
        else:
            table = sincos_2d(dim, grid_size)
        self.pos_embed = torch.nn.Parameter(table, requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.pos_embed[ids.to(self.pos_embed.device)]
