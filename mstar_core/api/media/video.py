"""Video content parts for chat: `{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,...",
"audio": false}}`, decoded with PyAV (FFmpeg) into frames sampled at a fixed rate and, when `audio` is true,
the video's audio track.

Bounds (`VideoLimits`, each overridable by `MSTAR_MEDIA_MAX_VIDEO_<NAME>`): bytes before decoding; the
container's duration, each frame's pixels, the sampled frame count and the pixels of all sampled frames together
(count x pixels: what becomes tensors downstream) before any frame is converted, the count from the duration and
again as frames are sampled. Frames are sampled at `fps` (Qwen3-Omni's published 2 per second): the frame shown at
each sample time, converted once however many sample times it covers. A file FFmpeg cannot read to the end (a
truncated MP4) is a 400 naming the part.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from mstar_core.api.media.b64 import b64_part
from mstar_core.api.media.limits import env_overrides
from mstar_core.errors import RequestError

MIME_TYPES = ("video/mp4", "video/webm", "video/quicktime", "video/x-matroska", "video/avi", "video/x-msvideo")


@attrs.frozen
class VideoLimits:
    max_video_bytes: int = 50 * 1024 * 1024
    max_video_seconds: float = 120.0
    max_video_frames: int = 256
    max_video_pixels: int = 1920 * 1088
    #: pixels of all sampled frames together: 24 Mi is ~72 MB of RGB (80 frames at 640x480, 12 at 1920x1088),
    #: a few hundred MB once a model turns them into float patches
    max_video_total_pixels: int = 24 * 1024 * 1024

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> VideoLimits:
        return attrs.evolve(cls(), **env_overrides(cls, "MSTAR_MEDIA_", environ))


@attrs.frozen(eq=False)
class VideoPart:
    """Sampled frames `[F, H, W, 3]` uint8 at `fps`, and the audio track (mono float32, `audio_rate`) if asked."""

    frames: np.ndarray
    fps: float
    field: str
    audio: np.ndarray | None = None
    audio_rate: int = 0

    @property
    def seconds(self) -> float:
        return self.frames.shape[0] / self.fps

    @property
    def text(self) -> str:
        return ""


def video_part(part: Mapping[str, Any], field: str, limits: VideoLimits | None = None, fps: float = 2.0) -> VideoPart:
    """A chat `video_url` part decoded (data URIs only: the server fetches no video)."""
    limits = limits or VideoLimits.from_env()
    value = part.get("video_url")
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str) or not url:
        raise RequestError(f"'{field}' must be an object with a 'url' (data:video/mp4;base64,...)", param=field)
    want_audio = bool(value.get("audio", False)) if isinstance(value, Mapping) else False
    head, comma, payload = url.partition(",")
    mime = head[5:].split(";")[0].strip().lower() if head.lower().startswith("data:") else ""
    if not comma or mime not in MIME_TYPES or ";base64" not in head.lower():
        raise RequestError(f"'{field}.url' must be a base64 data URI of a video ({', '.join(MIME_TYPES)}); "
                           "the server fetches no remote video", param=field)
    raw = b64_part(payload, f"{field}.url", field, limits.max_video_bytes)
    return decode_video(raw, field, limits, fps, want_audio)


def decode_video(raw: bytes, field: str, limits: VideoLimits, fps: float = 2.0, want_audio: bool = False) -> VideoPart:
    """Frames sampled at `fps` (and the audio track) from container bytes, bounded before conversion."""
    try:
        import av
    except ImportError:
        raise RequestError("video input needs PyAV (pip install av) on the server", status=501, param=field) from None
    try:
        container = av.open(io.BytesIO(raw), mode="r")
    except Exception as exc:  # FFmpeg's error for bytes that are no container it reads
        raise RequestError(f"'{field}' is not a video this server decodes ({type(exc).__name__})", param=field) from None
    try:
        with container:
            frames = _frames(container, field, limits, fps)
            audio, rate = _audio_track(raw, field, limits) if want_audio else (None, 0)
    except RequestError:
        raise
    except Exception as exc:  # FFmpeg (or PyAV on what it half read) failing mid-file: the file's fault
        raise RequestError(f"'{field}' could not be decoded to its end (a truncated or damaged file?): "
                           f"{type(exc).__name__}: {str(exc)[:200]}", param=field) from None
    if not frames:
        raise RequestError(f"'{field}' holds no decodable frames", param=field)
    return VideoPart(np.stack(frames), fps, field, audio, rate)


def _frames(container: Any, field: str, limits: VideoLimits, fps: float) -> list[np.ndarray]:
    if not container.streams.video:
        raise RequestError(f"'{field}' has no video stream", param=field)
    stream = container.streams.video[0]
    seconds = _duration(container, stream)
    if seconds is not None and seconds > limits.max_video_seconds:
        raise RequestError(f"'{field}' is {seconds:.1f} s long; this server takes at most "
                           f"{limits.max_video_seconds:g} s per video", status=413, param=field)
    codec = stream.codec_context
    width, height = (codec.width, codec.height) if codec is not None else (0, 0)
    if not width or not height:
        raise RequestError(f"'{field}' has a video stream without frame dimensions (a truncated or damaged file?)",
                           param=field)
    if width * height > limits.max_video_pixels:
        raise RequestError(f"'{field}' is {width}x{height}; this server takes at most {limits.max_video_pixels} "
                           "pixels per frame", status=413, param=field)
    if seconds is not None:
        _check_total(int(seconds * fps), width * height, fps, limits, field)  # (sampling may add one)
    return _sample_frames(container, stream, fps, limits, field)


def _check_total(count: int, pixels: int, fps: float, limits: VideoLimits, field: str) -> None:
    """`count` sampled frames of `pixels` each within the frame-count and total-pixel bounds (before converting)."""
    if count > limits.max_video_frames:
        raise RequestError(f"'{field}' samples to more than {limits.max_video_frames} frames at {fps:g} per "
                           "second; send a shorter video", status=413, param=field)
    if count * pixels > limits.max_video_total_pixels:
        raise RequestError(f"'{field}' samples to {count} frames of {pixels} pixels at {fps:g} per second, more "
                           f"than the {limits.max_video_total_pixels} pixels this server takes per video; send a "
                           "shorter or smaller video", status=413, param=field)


def _duration(container: Any, stream: Any) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000
    return None


def _sample_frames(container: Any, stream: Any, fps: float, limits: VideoLimits, field: str) -> list[np.ndarray]:
    """The frame on screen at t = 0, 1/fps, 2/fps, ... (decoded in order; only sampled frames are converted)."""
    out: list[np.ndarray] = []
    held, held_t = None, 0.0
    converted: tuple[Any, np.ndarray] | None = None  # a frame shown at several sample times is converted once

    def take(frame: Any) -> None:
        nonlocal converted
        _check_total(len(out) + 1, frame.width * frame.height, fps, limits, field)
        if converted is None or converted[0] is not frame:
            converted = (frame, frame.to_ndarray(format="rgb24"))
        out.append(converted[1])

    for frame in container.decode(stream):
        t = float(frame.pts * frame.time_base) if frame.pts is not None else held_t + 1.0 / 30
        if t > limits.max_video_seconds + 1.0:
            raise RequestError(f"'{field}' runs past {limits.max_video_seconds:g} s", status=413, param=field)
        while held is not None and len(out) / fps < t - 1e-6:  # that sample time fell while `held` was shown
            take(held)
        held, held_t = frame, t
    while held is not None and len(out) / fps <= held_t + 1e-6:
        take(held)
    return out


def _audio_track(raw: bytes, field: str, limits: VideoLimits) -> tuple[np.ndarray | None, int]:
    import av

    with av.open(io.BytesIO(raw), mode="r") as container:
        if not container.streams.audio:
            raise RequestError(f"'{field}.audio' is true but the video has no audio track", param=f"{field}.audio")
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="flt", layout="mono", rate=16000)
        chunks = []
        for frame in container.decode(stream):
            for out in resampler.resample(frame):
                chunks.append(out.to_ndarray().reshape(-1))
            if sum(c.size for c in chunks) > limits.max_video_seconds * 16000:
                raise RequestError(f"'{field}' audio runs past {limits.max_video_seconds:g} s", status=413, param=field)
        for out in resampler.resample(None):
            chunks.append(out.to_ndarray().reshape(-1))
    samples = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
    return samples, 16000
