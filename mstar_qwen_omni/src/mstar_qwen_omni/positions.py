"""M-RoPE positions of a prompt: text and audio advance all three axes together, an image spreads over (h, w).

A run of image placeholders (`grid_t * grid_h * grid_w / merge^2` ids) starts at the next free position
`p`: token (t, i, j) of its merged grid sits at `(p + t * position_id_per_seconds, p + i, p + j)`; the
next token starts after the largest position used. Audio placeholders and text are one position each.
Decoding continues after the prompt's largest position (what the kvcache engine does by itself).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def image_positions(start: int, grid_thw: Sequence[int], merge: int, per_second: int) -> torch.Tensor:
    """`[3, t * h * w / merge^2]` positions of one image's merged tokens, in the encoder's output order."""
    t, h, w = (int(v) for v in grid_thw)
    gh, gw = h // merge, w // merge
    tt = (torch.arange(t) * per_second).view(-1, 1, 1).expand(t, gh, gw)
    hh = torch.arange(gh).view(1, -1, 1).expand(t, gh, gw)
    ww = torch.arange(gw).view(1, 1, -1).expand(t, gh, gw)
    return torch.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + start


def prompt_positions(
    ids: Sequence[int],
    image_token_id: int,
    image_grids: Sequence[Sequence[int]] = (),
    merge: int = 2,
    per_second: int = 13,
    start: int = 0,
) -> torch.Tensor:
    """`[3, len(ids)]` positions for a prompt whose image placeholder runs follow `image_grids` in order."""
    out: list[torch.Tensor] = []
    grids = list(image_grids)
    i, nxt, n = 0, start, len(ids)
    while i < n:
        if ids[i] == image_token_id:
            if not grids:
                raise ValueError("more image placeholder runs than images")
            grid = grids.pop(0)
            pos = image_positions(nxt, grid, merge, per_second)
            count = pos.shape[1]
            if ids[i : i + count] != [image_token_id] * count:
                raise ValueError(f"image placeholder run at {i} must have {count} tokens")
            out.append(pos)
            nxt = int(pos.max()) + 1
            i += count
            continue
        j = i
        while j < n and ids[j] != image_token_id:
            j += 1
        out.append(torch.arange(nxt, nxt + j - i).expand(3, -1))
        nxt += j - i
        i = j
    if grids:
        raise ValueError(f"{len(grids)} image(s) without placeholders")
    return torch.cat(out, dim=1) if out else torch.zeros(3, 0, dtype=torch.long)
