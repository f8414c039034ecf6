"""Band-limited resampling of mono audio (models and the realtime socket convert rates with it)."""

from __future__ import annotations

import numpy as np


def resample(samples: np.ndarray, src: int, dst: int, *, zero_crossings: int = 16) -> np.ndarray:
    """Band-limited resampling of mono float samples from `src` to `dst` Hz (Hann-windowed sinc, cut-off at the
    lower Nyquist), evaluated directly at each output time in blocks."""
    samples = np.asarray(samples, dtype=np.float32)
    if src == dst or samples.size == 0:
        return samples
    ratio = dst / src
    cutoff = min(1.0, ratio)  # of the input's Nyquist
    half = zero_crossings / cutoff  # filter half-width in input samples
    n_out = int(np.ceil(samples.size * ratio))
    out = np.empty(n_out, dtype=np.float32)
    offsets = np.arange(-int(np.ceil(half)), int(np.ceil(half)) + 1)
    padded = np.pad(samples, (offsets.size, offsets.size))
    block = max(1, 2**20 // offsets.size)
    for start in range(0, n_out, block):
        t = np.arange(start, min(n_out, start + block)) / ratio  # output times in input samples
        base = np.floor(t).astype(np.int64)
        idx = base[:, None] + offsets[None, :]
        dist = t[:, None] - idx
        window = np.where(np.abs(dist) < half, 0.5 + 0.5 * np.cos(np.pi * dist / half), 0.0)
        weights = cutoff * np.sinc(cutoff * dist) * window
        out[start:start + t.size] = (padded[idx + offsets.size] * weights).sum(axis=1)
    return out
