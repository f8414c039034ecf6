"""M-RoPE positions of a prompt: text and audio advance all three axes together, an image spreads over (h, w).

A run of image placeholders (`grid_t * grid_h * grid_w / merge^2` ids) starts at the next free position
`p`: token (t, i, j) of its merged grid sits at `(p + t * position_id_per_seconds, p + i, p + j)`; the
next token starts after the largest position used. Audio placeholders and text are one position each.
A video's placeholder run is laid out the same way with its temporal patches `seconds_per_grid` apart:
token (t, i, j) at `(p + t * seconds_per_grid * position_id_per_seconds, p + i, p + j)` (transformers'
`get_rope_index` for a video without its audio interleaved).
Decoding continues after the prompt's largest position (what the kvcache engine does by itself).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def image_positions(start: int, grid_thw: Sequence[int], merge: int, per_second: float) -> torch.Tensor:
    """`[3, t * h * w / merge^2]` positions of one image's (or video's) merged tokens, in the encoder's output order;
    temporal patch t sits `t * per_second` after the start (truncated to an integer, as transformers' long cast)."""
    t, h, w = (int(v) for v in grid_thw)
    gh, gw = h // merge, w // merge
    tt = (torch.arange(t, dtype=torch.float64) * per_second).long().view(-1, 1, 1).expand(t, gh, gw)
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
    video_token_id: int | None = None,
    video_grids: Sequence[Sequence[int]] = (),
    video_seconds_per_grid: Sequence[float] = (),
) -> torch.Tensor:
    """`[3, len(ids)]` positions for a prompt whose image and video placeholder runs follow their grids in order."""
    out: list[torch.Tensor] = []
    runs = {image_token_id: [(g, per_second) for g in image_grids]}
    if video_token_id is not None:
        runs[video_token_id] = [(g, s * per_second) for g, s in zip(video_grids, video_seconds_per_grid, strict=True)]
    i, nxt, n = 0, start, len(ids)
    while i < n:
        if ids[i] in runs:
            token = ids[i]
            if not runs[token]:
                raise ValueError("more image or video placeholder runs than images or videos")
            grid, step = runs[token].pop(0)
            pos = image_positions(nxt, grid, merge, step)
            count = pos.shape[1]
            if ids[i : i + count] != [token] * count:
                raise ValueError(f"placeholder run at {i} must have {count} tokens")
            out.append(pos)
            nxt = int(pos.max()) + 1
            i += count
            continue
        j = i
        while j < n and ids[j] not in runs:
            j += 1
        out.append(torch.arange(nxt, nxt + j - i).expand(3, -1))
        nxt += j - i
        i = j
    if any(runs.values()):
        raise ValueError(f"{sum(len(r) for r in runs.values())} image(s) or video(s) without placeholders")
    return torch.cat(out, dim=1) if out else torch.zeros(3, 0, dtype=torch.long)
