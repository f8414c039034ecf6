"""Encoding a generated video for `GET /v1/videos/{id}/content`: uint8 frames -> H.264 MP4 bytes (PyAV's FFmpeg)."""

from __future__ import annotations

import io
from fractions import Fraction
from typing import Any

import numpy as np


def encode_mp4(frames: Any, fps: int, *, crf: int = 18) -> bytes:
    """`frames` `[T, H, W, 3]` uint8 (a tensor or array) -> an MP4 (H.264, yuv420p, `fps` frames per second).

    Odd sides are padded by one edge pixel (4:2:0 chroma needs even ones).
    """
    import av

    array = np.ascontiguousarray(np.asarray(frames, dtype=np.uint8))
    if array.ndim != 4 or array.shape[-1] != 3 or array.shape[0] < 1:
        raise ValueError(f"frames must be [T, H, W, 3] uint8 with T >= 1, got shape {list(array.shape)}")
    _, h, w, _ = array.shape
    if h % 2 or w % 2:
        array = np.pad(array, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(int(fps), 1))
        stream.width, stream.height = array.shape[2], array.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf), "preset": "veryfast"}
        for frame in array:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()
