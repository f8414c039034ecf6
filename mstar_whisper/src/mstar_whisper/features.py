"""Whisper's input: 16 kHz audio -> `[n_mels, 3000]` log-mel features of one 30-second window.

The same log-mel as `mstar_core.nn.whisper_features` (Hann STFT, Slaney mels, log10, clamp to max - 8, (x + 4) / 4),
over the audio zero-padded (or cut) to the window first, as `WhisperFeatureExtractor` does: the clamp's maximum is
the window's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mstar_core.nn.whisper_features import LogMelFeatures


class WhisperFeatures:
    def __init__(self, n_mels: int = 80, sampling_rate: int = 16000, n_fft: int = 400, hop_length: int = 160,
                 chunk_length: int = 30):
        self.sampling_rate, self.hop_length = sampling_rate, hop_length
        self.n_samples = chunk_length * sampling_rate
        self.frames = self.n_samples // hop_length
        self.mel = LogMelFeatures(n_mels, n_fft, hop_length, sampling_rate)

    @classmethod
    def from_preprocessor_config(cls, raw: Mapping[str, Any]) -> WhisperFeatures:
        return cls(int(raw.get("feature_size", 80)), int(raw.get("sampling_rate", 16000)), int(raw.get("n_fft", 400)),
                   int(raw.get("hop_length", 160)), int(raw.get("chunk_length", 30)))

    def __call__(self, audio: torch.Tensor) -> torch.Tensor:
        """One window (`audio` of at most 30 s; longer is cut) -> `[n_mels, 3000]` float32."""
        wav = torch.as_tensor(audio, dtype=torch.float32).flatten()[: self.n_samples]
        wav = torch.nn.functional.pad(wav, (0, self.n_samples - wav.numel()))
        return self.mel(wav)
