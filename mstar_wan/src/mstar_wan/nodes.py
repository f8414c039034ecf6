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
    """`vae_decode` (stateless): latent frames `[chunk*k, (chunk+1)*k)` of each request -> its RGB frames.

    The causal convs' frames from the previous chunk come in as `vae_cache` and the updated ones go out, so
    the walk's decode `Loop` streams the video chunk by chunk (each chunk's `frames` is emitted as it is
    decoded) and the result equals decoding the whole latent video at once. With a TI2V `condition`, the
    first latent frame is the image's (the reference overwrites it after the loop). Requests at the same chunk
    of same-sized videos decode as one batch (their caches stacked row by row, then split back).
    """

    def __init__(self, vae: WanVAE, chunk_frames: int):
        super().__init__()
        self.vae = vae
        self.chunk_frames = chunk_frames

    def forward(self, latents: torch.Tensor, chunk: int, vae_cache: list | None = None,
                condition: torch.Tensor | None = None) -> dict[str, Any]:
        return self.forward_batch([{"latents": latents, "chunk": chunk, "vae_cache": vae_cache,
                                    "condition": condition}])[0]

    def forward_batch(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        groups: dict[tuple, list[int]] = {}
        for i, call in enumerate(calls):
            groups.setdefault(self._key(call), []).append(i)
        out: list[dict[str, Any]] = [{} for _ in calls]
        for members in groups.values():
            for i, result in zip(members, self._decode([calls[i] for i in members]), strict=True):
                out[i] = result
        return out

    def _key(self, call: dict[str, Any]) -> tuple:
        cache = call.get("vae_cache")
        slots = None if cache is None else tuple(None if t is None else tuple(t.shape) for t in cache)
        return tuple(call["latents"].shape), int(call["chunk"]), slots

    def _slice(self, call: dict[str, Any]) -> torch.Tensor:
        start = int(call["chunk"]) * self.chunk_frames
        z = call["latents"][:, start: start + self.chunk_frames]
        condition = call.get("condition")
        if condition is not None and start == 0:
            z = torch.cat([condition.to(z), z[:, 1:]], dim=1)
        return z

    def _decode(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        w = self.vae.post_quant_conv.weight
        z = torch.stack([self._slice(c) for c in calls]).to(w.device, w.dtype)
        caches = [c.get("vae_cache") for c in calls]
        slots = None if caches[0] is None else [None if caches[0][j] is None else torch.cat([c[j] for c in caches])
                                                 for j in range(len(caches[0]))]
        cache = FrameCache(slots)
        pixels = self.vae.decode_chunk(z, first=int(calls[0]["chunk"]) == 0, cache=cache)
        frames = ((pixels.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)  # [B, 3, T, H, W]
        frames = frames.permute(0, 2, 3, 4, 1).cpu()
        return [{"frames": frames[b].contiguous(),
                 "vae_cache": [None if t is None else t[b: b + 1] for t in cache.slots]} for b in range(len(calls))]


def join_frames(video_chunks: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """`join` (function): the decoded chunks -> the video `[T, H, W, 3]` uint8."""
    return {"video": torch.cat(list(video_chunks), dim=0)}
