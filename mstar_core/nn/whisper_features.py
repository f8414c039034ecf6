"""Whisper-style log-mel features: 16 kHz audio -> `[n_mels, samples // hop]` frames (Whisper, Qwen-Omni audio towers).

Power spectrogram of a centred (reflect-padded) Hann STFT, Slaney-scale triangular mel filters with Slaney
area normalisation (0-8 kHz), log10 floored at 1e-10, clamped to 8 below its maximum, then `(x + 4) / 4`;
the STFT's last frame is dropped, so a clip of n samples gives n // hop frames. No padding to 30 s: the
caller pads if its model wants fixed-length input.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney's scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    log_step = 27.0 / math.log(6.4)
    return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) * log_step, 3.0 * f / 200.0)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    log_step = math.log(6.4) / 27.0
    return np.where(m >= 15.0, 1000.0 * np.exp(log_step * (m - 15.0)), 200.0 * m / 3.0)


def mel_filters(n_fft: int = 400, n_mels: int = 128, sampling_rate: int = 16000,
                fmin: float = 0.0, fmax: float = 8000.0) -> torch.Tensor:
    """`[n_fft // 2 + 1, n_mels]` triangular filters on the Slaney scale, each normalised to unit area."""
    mels = np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2)
    edges = _mel_to_hz(mels)
    fft_freqs = np.linspace(0, sampling_rate // 2, n_fft // 2 + 1)
    width = np.diff(edges)
    slopes = edges[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / width[:-1]
    up = slopes[:, 2:] / width[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    filters *= 2.0 / (edges[2 : n_mels + 2] - edges[:n_mels])
    return torch.from_numpy(filters.astype(np.float32))


class LogMelFeatures:
    """`__call__(waveform [samples] float)` -> `[n_mels, samples // hop]` float32 log-mel features."""

    def __init__(self, n_mels: int = 128, n_fft: int = 400, hop_length: int = 160, sampling_rate: int = 16000):
        self.n_fft, self.hop_length, self.sampling_rate = n_fft, hop_length, sampling_rate
        self.filters = mel_filters(n_fft, n_mels, sampling_rate)
        self.window = torch.hann_window(n_fft)

    def __call__(self, waveform: torch.Tensor) -> torch.Tensor:
        wav = torch.as_tensor(waveform, dtype=torch.float32).flatten()
        if wav.numel() < self.n_fft // 2 + 1:
            raise ValueError(f"audio too short: {wav.numel()} samples, need at least {self.n_fft // 2 + 1}")
        stft = torch.stft(wav, self.n_fft, self.hop_length, window=self.window.to(wav.device), return_complex=True)
        power = (stft[..., :-1].abs() ** 2).contiguous()
        mel = self.filters.to(wav.device).t() @ power
        log = mel.clamp(min=1e-10).log10()
        log = torch.maximum(log, log.max() - 8.0)
        return (log + 4.0) / 4.0
