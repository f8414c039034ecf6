"""The `snac` graph node: decodes 28-token windows of audio tokens, many requests' windows per call."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mstar_orpheus.codes import AudioTokenMap, tokens_to_codes, window_slice
from mstar_orpheus.snac import SNACDecoder


def window_seed(noise_seed: int, start: int) -> int:
    """Seed of one window's noise: fixed by the request's seed and the window's position in the stream."""
    return (int(noise_seed) * 1_000_003 + int(start)) % (2**63)


class SNACWindowDecoder(nn.Module):
    """Audio tokens -> the reference's emitted slice of each window, as float32 samples in [-1, 1].

    Runs in fp32 on the stateless engine. `forward_batch` takes one input dict per invocation
    (`codes`: a `Chunk` of kept audio token ids; optional `noise_seed`) and decodes every window of
    the same length in one batched SNAC call.
    """

    def __init__(self, snac: SNACDecoder, tokens: AudioTokenMap):
        super().__init__()
        self.snac = snac
        self.tokens = tokens
        self.slice = window_slice(snac.config.hop_length)

    @property
    def device(self) -> torch.device:
        return next(self.snac.parameters()).device

    @torch.inference_mode()
    def decode_windows(self, windows: Sequence[tuple[Sequence[int], int, int]]) -> list[torch.Tensor]:
        """(token ids, kept-index start, noise seed) per window -> emitted samples (empty if invalid)."""
        out = [torch.zeros(0, dtype=torch.float32) for _ in windows]
        groups: dict[int, list[tuple[int, list[torch.Tensor], int]]] = defaultdict(list)
        for i, (ids, start, seed) in enumerate(windows):
            codes = tokens_to_codes(ids, start, self.tokens)
            if codes is not None:  # the reference skips windows holding out-of-codebook codes
                groups[codes[0].shape[1]].append((i, codes, seed))
        for members in groups.values():
            levels = [torch.cat([m[1][lv] for m in members]).to(self.device) for lv in range(3)]
            audio = self.snac.decode(levels, seeds=[m[2] for m in members])[:, 0, self.slice]
            for row, (i, _, _) in enumerate(members):
                out[i] = audio[row].float().cpu()
        return out

    def decode_window(self, ids: Sequence[int], start: int, noise_seed: int = 0) -> torch.Tensor:
        """One window's emitted samples (the offline reference path)."""
        return self.decode_windows([(ids, start, window_seed(noise_seed, start))])[0]

    def forward_batch(self, inputs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The stateless engine's batched call: one `{"audio": samples}` per input dict."""
        windows = []
        for item in inputs:
            chunk = item["codes"]
            seed = window_seed(item.get("noise_seed") or 0, chunk.start)
            windows.append(([int(t) for t in chunk.items], chunk.start, seed))
        return [{"audio": a} for a in self.decode_windows(windows)]

    def forward(self, codes: Any, noise_seed: int = 0) -> dict[str, Any]:
        """Unbatched call: one chunk in, its audio out."""
        return self.forward_batch([{"codes": codes, "noise_seed": noise_seed}])[0]
