"""An uploaded audio file (the transcriptions route's multipart `file`) checked and decoded: size, container and
duration bounded before the samples decode."""

from __future__ import annotations

import io

import numpy as np

from mstar_core.api.http.errors import ApiError
from mstar_core.api.media.limits import MediaLimits

#: libsndfile's names for the containers taken
CONTAINERS = {"WAV", "WAVEX", "RF64", "FLAC", "OGG", "MP3"}


def decode_upload(raw: bytes, limits: MediaLimits) -> tuple[np.ndarray, int]:
    """Mono float32 samples and their rate; size, container and duration checked before the samples decode."""
    import soundfile

    if not raw:
        raise ApiError(400, "'file' is empty", param="file")
    if len(raw) > limits.max_audio_bytes:
        raise ApiError(413, f"'file' is {len(raw)} bytes; this server takes at most {limits.max_audio_bytes}",
                       param="file")
    try:
        info = soundfile.info(io.BytesIO(raw))
    except Exception as exc:  # libsndfile's error for bytes that are no audio it reads
        raise ApiError(400, f"'file' is not audio this server decodes (WAV, FLAC, OGG, MP3): {exc}",
                       param="file") from None
    if info.format not in CONTAINERS:
        raise ApiError(400, f"'file' is {info.format} audio; send WAV, FLAC, OGG or MP3", param="file")
    seconds = info.frames / max(1, info.samplerate)
    if seconds > limits.max_audio_seconds:
        raise ApiError(413, f"'file' is {seconds:.1f} s long; this server takes at most "
                            f"{limits.max_audio_seconds:g} s", param="file")
    if not 1000 <= info.samplerate <= 384_000:
        raise ApiError(400, f"'file' has a sample rate of {info.samplerate} Hz; send 1-384 kHz", param="file")
    try:
        data, rate = soundfile.read(io.BytesIO(raw), dtype="float32", always_2d=True)
    except Exception as exc:
        raise ApiError(400, f"'file' could not be decoded: {exc}", param="file") from None
    if data.shape[0] < rate // 10:
        raise ApiError(400, "'file' holds less than 0.1 s of audio", param="file")
    return np.ascontiguousarray(data.mean(axis=1, dtype=np.float32)), int(rate)
