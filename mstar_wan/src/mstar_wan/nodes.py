"""The modules of Wan's graph nodes besides the DiT and the text encoder (those are `transformer`, `text_encoder`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mstar_wan.vae import FrameCache, WanVAE


class EncodeImageNode(nn.Module):
    """`encode_image` (stateless): the first frame `[3, H, W]` in [-1, 1] -> its normalised latents `[z, 1, h, w]`."""

    def __init__(self, vae: WanVAE):
        super().__init__()
        self.vae = vae

    def forward(self, image: torch.Tensor) -> dict[str, torch.Tensor]:
        w = self.vae.quant_conv.weight
        video = image.to(w.device, w.dtype)[:, :, None]  # stacked: [B, 3, 1, H, W]
        return {"condition": self.vae.encode_mode(video)}


class DecodeChunkNode(nn.Module):
    """`vae_decode` (stateless, one call per request and chunk): latent frames `[chunk*k, (chunk+1)*k)` -> RGB frames.

    The causal convs' frames from the previous chunk come in as `vae_cache` and the updated ones go out, so
    the walk's decode `Loop` streams the video chunk by chunk (each chunk's `frames` is emitted as it is
    decoded) and the result equals decoding the whole latent video at once. With a TI2V `condition`, the
    first latent frame is the image's (the reference overwrites it after the loop).
    """

    def __init__(self, vae: WanVAE, chunk_frames: int):
        super().__init__()
        self.vae = vae
        self.chunk_frames = chunk_frames

    def forward(self, latents: torch.Tensor, chunk: int, vae_cache: list | None = None,
                condition: torch.Tensor | None = None) -> dict[str, Any]:
        start = int(chunk) * self.chunk_frames
        z = latents[:, start: start + self.chunk_frames]
        if condition is not None and start == 0:
            z = torch.cat([condition.to(z), z[:, 1:]], dim=1)
        w = self.vae.post_quant_conv.weight
        cache = FrameCache(vae_cache)
        pixels = self.vae.decode_chunk(z[None].to(w.device, w.dtype), first=start == 0, cache=cache)[0]
        frames = ((pixels.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)  # [3, T, H, W]
        return {"frames": frames.permute(1, 2, 3, 0).contiguous().cpu(), "vae_cache": cache.slots}


def join_frames(video_chunks: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """`join` (function): the decoded chunks -> the video `[T, H, W, 3]` uint8."""
    return {"video": torch.cat(list(video_chunks), dim=0)}
