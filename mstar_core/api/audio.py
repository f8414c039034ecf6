"""Audio response encoders: streamed WAV (open-ended header) and raw PCM, buffered FLAC."""

from __future__ import annotations

import io
import struct

import numpy as np

#: Data-size value for a WAV whose length is unknown when the header is sent (as streaming servers do).
STREAMING_SIZE = 0xFFFFFFFF

MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac"}


def wav_header(sample_rate: int, num_samples: int | None = None, channels: int = 1) -> bytes:
    """A 44-byte PCM s16le WAV header; `num_samples=None` writes the open-ended streaming sizes."""
    block = 2 * channels
    if num_samples is None:
        data_size = riff_size = STREAMING_SIZE
    else:
        data_size = num_samples * block
        riff_size = 36 + data_size
    return (
        b"RIFF" + struct.pack("<I", riff_size) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block, block, 16)
        + b"data" + struct.pack("<I", data_size)
    )


class AudioEncoder:
    """Turns int16 chunks into response bytes; `stream` says whether bytes can go out before the end."""

    def __init__(self, fmt: str, sample_rate: int, *, stream: bool = True):
        if fmt not in MEDIA_TYPES:
            raise ValueError(f"unsupported audio format '{fmt}'; supported: {', '.join(MEDIA_TYPES)}")
        self.fmt = fmt
        self.sample_rate = sample_rate
        # FLAC frames need the whole signal here; a WAV with exact sizes does too
        self.stream = stream and fmt != "flac"
        self._held: list[np.ndarray] = []
        self.samples = 0
        self._started = False

    @property
    def media_type(self) -> str:
        return MEDIA_TYPES[self.fmt]

    def chunk(self, pcm: np.ndarray) -> bytes:
        """Bytes to send now for this chunk (may be empty when the format buffers)."""
        pcm = np.ascontiguousarray(pcm, dtype="<i2")
        self.samples += pcm.size
        if not self.stream:
            self._held.append(pcm)
            return b""
        head = b""
        if not self._started and self.fmt == "wav":
            head = wav_header(self.sample_rate, None)
        self._started = True
        return head + pcm.tobytes()

    def finish(self) -> bytes:
        """Bytes that complete the response."""
        if self.stream:
            if not self._started and self.fmt == "wav":
                return wav_header(self.sample_rate, 0)
            return b""
        pcm = np.concatenate(self._held) if self._held else np.zeros(0, dtype="<i2")
        if self.fmt == "wav":
            return wav_header(self.sample_rate, pcm.size) + pcm.tobytes()
        if self.fmt == "pcm":
            return pcm.tobytes()
        import soundfile

        buf = io.BytesIO()
        soundfile.write(buf, pcm, self.sample_rate, format="FLAC", subtype="PCM_16")
        return buf.getvalue()
