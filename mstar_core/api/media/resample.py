"""Band-limited resampling of mono audio (models and the realtime socket convert rates with it)."""

from __future__ import annotations

from math import gcd

import numpy as np


def resample(samples: np.ndarray, src: int, dst: int, *, zero_crossings: int = 16) -> np.ndarray:
    """Band-limited resampling of mono float samples from `src` to `dst` Hz (Hann-windowed sinc, cut-off at the
    lower Nyquist), evaluated at each output time.

    Between whole-number rates the output times fall on `up` phases between input samples (`dst / src` reduced to
    `up / down`), so each phase's filter taps are computed once and every output is a dot product with its input
    window (24 -> 16 kHz: two phases; ~3 s of audio in milliseconds, not the quarter second that evaluating the
    sinc at every tap took). Other rates evaluate the filter at each output time (`_direct`)."""
    samples = np.asarray(samples, dtype=np.float32)
    if src == dst or samples.size == 0:
        return samples
    if int(src) != src or int(dst) != dst:
        return _direct(samples, src, dst, zero_crossings)
    src, dst = int(src), int(dst)
    ratio = dst / src
    cutoff, half, offsets = _filter(ratio, zero_crossings)
    n_out = int(np.ceil(samples.size * ratio))
    out = np.empty(n_out, dtype=np.float32)
    padded = np.pad(samples, (offsets.size, offsets.size))
    # windows[i] is padded[i : i + taps]: the input window of an output whose first tap is padded[i]
    windows = np.lib.stride_tricks.sliding_window_view(padded, offsets.size)
    g = gcd(src, dst)
    up, down = dst // g, src // g
    block = max(1, 2**20 // offsets.size)
    for phase in range(min(up, n_out)):
        # outputs k = phase + j * up sit at input time k * down / up = base + frac, frac the same for all of them
        frac = ((phase * down) % up) / up
        dist = frac - offsets
        weights = _weights(dist, cutoff, half)
        ks = np.arange(phase, n_out, up)
        for at in range(0, ks.size, block):
            k = ks[at:at + block]
            first = (k * down) // up + offsets[0] + offsets.size
            out[k] = windows[first] @ weights
    return out


def _filter(ratio: float, zero_crossings: int) -> tuple[float, float, np.ndarray]:
    cutoff = min(1.0, ratio)  # of the input's Nyquist
    half = zero_crossings / cutoff  # filter half-width in input samples
    return cutoff, half, np.arange(-int(np.ceil(half)), int(np.ceil(half)) + 1)


def _weights(dist: np.ndarray, cutoff: float, half: float) -> np.ndarray:
    window = np.where(np.abs(dist) < half, 0.5 + 0.5 * np.cos(np.pi * dist / half), 0.0)
    return cutoff * np.sinc(cutoff * dist) * window


def _direct(samples: np.ndarray, src: float, dst: float, zero_crossings: int) -> np.ndarray:
    """The filter evaluated at every output time (rates that are not whole numbers), in blocks."""
    ratio = dst / src
    cutoff, half, offsets = _filter(ratio, zero_crossings)
    n_out = int(np.ceil(samples.size * ratio))
    out = np.empty(n_out, dtype=np.float32)
    padded = np.pad(samples, (offsets.size, offsets.size))
    block = max(1, 2**20 // offsets.size)
    for start in range(0, n_out, block):
        t = np.arange(start, min(n_out, start + block)) / ratio  # output times in input samples
        base = np.floor(t).astype(np.int64)
        idx = base[:, None] + offsets[None, :]
        out[start:start + t.size] = (padded[idx + offsets.size] * _weights(t[:, None] - idx, cutoff, half)).sum(axis=1)
    return out
