"""A spoken turn for the tests and the benchmark: espeak-ng's voice when installed, else a voiced-speech stand-in."""

from __future__ import annotations

import io
import shutil
import subprocess
import wave

import numpy as np

RATE = 24_000


def speech(text: str = "Hello there. What is the weather like today?") -> np.ndarray:
    """`text` spoken, int16 mono at 24 kHz."""
    from mstar_core.api.media import resample

    if shutil.which("espeak-ng"):
        wav = subprocess.run(["espeak-ng", "--stdout", "-s", "170", text], capture_output=True, check=True,
                             timeout=30).stdout
        with wave.open(io.BytesIO(wav)) as w:
            rate, pcm = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
        samples = resample(pcm.astype(np.float32) / 32768.0, rate, RATE)
        return (np.clip(samples, -1, 1) * 32767).astype(np.int16)
    t = np.arange(int(1.5 * RATE)) / RATE  # no espeak-ng: a harmonic tone with a syllable envelope
    voiced = sum(np.sin(2 * np.pi * 180 * k * t) / k for k in range(1, 6))
    return (0.3 * voiced / 2.3 * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t)) * 32767).astype(np.int16)


def silence(seconds: float, noise: float = 0.0005, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(int(seconds * RATE)) * noise * 32767).astype(np.int16)
