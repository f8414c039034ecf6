"""Audio response encoders: WAV (open-ended header when streamed), raw PCM, and FLAC, MP3, Opus and AAC
through PyAV (FFmpeg); every one streams as the model produces samples, or buffers with exact sizes.

A streamed FLAC cannot say its length up front (STREAMINFO's sample count is 0, "unknown"): valid FLAC that
FFmpeg and browsers play, but some readers (libsndfile) refuse it, so the speech route streams FLAC only when
the request asks (`stream: true`) and otherwise sends it whole with exact sizes.
"""

from __future__ import annotations

import struct

import numpy as np

#: Data-size value for a WAV whose length is unknown when the header is sent (as streaming servers do).
STREAMING_SIZE = 0xFFFFFFFF

MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg",
               "opus": "audio/ogg", "aac": "audio/aac"}
#: The formats served, in the order the docs list them.
FORMATS = tuple(MEDIA_TYPES)
#: format -> (FFmpeg muxer, encoder, muxer options): each muxer writes to a pipe (no seeking back for sizes)
_CODECS = {
    "flac": ("flac", "flac", {}),
    "mp3": ("mp3", "libmp3lame", {}),
    # Ogg pages flush every 20 ms instead of every second, so streamed Opus leaves with the samples it carries
    "opus": ("ogg", "libopus", {"page_duration": "20000"}),
    "aac": ("adts", "aac", {}),
}
#: Sample rates libopus encodes; another rate is resampled to the next one up.
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)


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


class _Sink:
    """A write-only file for FFmpeg's muxer: what it writes is collected until taken (no seek: a pipe)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, b: bytes) -> int:
        self.data += b
        return len(b)

    def take(self) -> bytes:
        out = bytes(self.data)
        self.data.clear()
        return out


class _Codec:
    """One FFmpeg encoder + muxer over int16 mono chunks; `push` returns the container bytes ready so far."""

    def __init__(self, fmt: str, sample_rate: int, *, seekable: bool = False):
        import io

        import av

        muxer, codec, options = _CODECS[fmt]
        self._av = av
        self.rate = sample_rate
        if codec == "libopus" and sample_rate not in _OPUS_RATES:
            self.rate = next((r for r in _OPUS_RATES if r >= sample_rate), 48000)
        # buffered, the muxer may seek back and write exact sizes (FLAC's STREAMINFO sample count)
        self._buffer = io.BytesIO() if seekable else None
        self._sink = _Sink()
        self._container = av.open(self._buffer if seekable else self._sink, mode="w", format=muxer,
                                  options=dict(options))
        self._stream = self._container.add_stream(codec, rate=self.rate, layout="mono")
        self._resampler = None
        if self.rate != sample_rate:
            self._resampler = av.AudioResampler(format="s16", layout="mono", rate=self.rate)
        self._input_rate = sample_rate
        self._pts = 0

    def push(self, pcm: np.ndarray | None) -> bytes:
        if pcm is None:  # flush the encoder and close the container (trailers, last pages)
            for packet in self._stream.encode(None):
                self._container.mux(packet)
            self._container.close()
            return self._buffer.getvalue() if self._buffer is not None else self._sink.take()
        if pcm.size == 0:
            return b""
        frame = self._av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self._input_rate
        frame.pts = self._pts
        self._pts += pcm.size
        frames = self._resampler.resample(frame) if self._resampler is not None else [frame]
        for f in frames:
            for packet in self._stream.encode(f):
                self._container.mux(packet)
        return self._sink.take()


class AudioEncoder:
    """Turns int16 chunks into response bytes; `stream` says whether bytes can go out before the end."""

    def __init__(self, fmt: str, sample_rate: int, *, stream: bool = True):
        if fmt not in MEDIA_TYPES:
            raise ValueError(f"unsupported audio format '{fmt}'; supported: {', '.join(MEDIA_TYPES)}")
        self.fmt = fmt
        self.sample_rate = sample_rate
        self.stream = stream
        self._held: list[np.ndarray] = []
        self.samples = 0
        self._started = False
        self._codec = _Codec(fmt, sample_rate, seekable=not stream) if fmt in _CODECS else None

    @property
    def media_type(self) -> str:
        return MEDIA_TYPES[self.fmt]

    def chunk(self, pcm: np.ndarray) -> bytes:
        """Bytes to send now for this chunk (empty when not streaming, or while the codec fills a frame)."""
        pcm = np.ascontiguousarray(pcm, dtype="<i2").reshape(-1)
        self.samples += pcm.size
        if self._codec is not None:
            data = self._codec.push(pcm)
            return data if self.stream else b""
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
        if self._codec is not None:
            return self._codec.push(None)
        if self.stream:
            if not self._started and self.fmt == "wav":
                return wav_header(self.sample_rate, 0)
            return b""
        pcm = np.concatenate(self._held) if self._held else np.zeros(0, dtype="<i2")
        if self.fmt == "wav":
            return wav_header(self.sample_rate, pcm.size) + pcm.tobytes()
        return pcm.tobytes()
