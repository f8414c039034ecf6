"""Encoding a generated video for `GET /v1/videos/{id}/content`: uint8 frames -> H.264 MP4 bytes (PyAV's FFmpeg)."""

from __future__ import annotations

import io
from fractions import Fraction
from typing import Any

import numpy as np


class Mp4Writer:
    """An MP4 written chunk by chunk as a video is decoded (`add` per chunk of frames, then `close` for the bytes).

    The encoder's work overlaps the rest of the decode, so the file is ready right after the last chunk. With
    `size` (width, height) the frames are scaled to it as they are encoded: the size a client asked for, where the
    model draws on its own grid (multiples of 32, or a tiny preset's scaled-down one).
    """

    def __init__(self, fps: int, *, crf: int = 18, size: tuple[int, int] | None = None):
        self.fps, self.crf = int(fps), crf
        # 4:2:0 chroma needs even sides: an odd one asked for is rounded up
        self.size = None if size is None else (int(size[0]) + int(size[0]) % 2, int(size[1]) + int(size[1]) % 2)
        self.frames = 0
        self._out = io.BytesIO()
        self._container: Any = None
        self._stream: Any = None
        self._shape: tuple[int, int] | None = None

    def add(self, frames: Any) -> None:
        import av

        array = _checked(frames)
        if self._container is None:
            self._shape = array.shape[1:3]
            self._container = av.open(self._out, mode="w", format="mp4")
            width, height = self.size or (array.shape[2], array.shape[1])
            self._stream = _video_stream(self._container, width, height, self.fps, self.crf)
        elif array.shape[1:3] != self._shape:
            raise ValueError(f"a chunk of {list(array.shape[1:3])} frames in a {list(self._shape)} video")
        scale = self.size is not None and self.size != (array.shape[2], array.shape[1])
        for frame in array:
            picture = av.VideoFrame.from_ndarray(frame, format="rgb24")
            if scale:  # (swscale's bicubic, in the encoder's own pixel format)
                picture = picture.reformat(width=self.size[0], height=self.size[1], format="yuv420p")
            for packet in self._stream.encode(picture):
                self._container.mux(packet)
        self.frames += len(array)

    def close(self) -> bytes:
        if self._container is None:
            raise ValueError("no frames were written")
        for packet in self._stream.encode():
            self._container.mux(packet)
        self._container.close()
        return self._out.getvalue()


def _checked(frames: Any) -> np.ndarray:
    array = np.ascontiguousarray(np.asarray(frames, dtype=np.uint8))
    if array.ndim != 4 or array.shape[-1] != 3 or array.shape[0] < 1:
        raise ValueError(f"frames must be [T, H, W, 3] uint8 with T >= 1, got shape {list(array.shape)}")
    _, h, w, _ = array.shape
    if h % 2 or w % 2:  # 4:2:0 chroma needs even sides: pad by one edge pixel
        array = np.pad(array, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    return array


def _video_stream(container: Any, width: int, height: int, fps: int, crf: int) -> Any:
    stream = container.add_stream("libx264", rate=Fraction(int(fps), 1))
    stream.width, stream.height = width, height
    stream.pix_fmt = "yuv420p"
    stream.options = {"crf": str(crf), "preset": "veryfast"}
    return stream


def encode_mp4(frames: Any, fps: int, *, crf: int = 18) -> bytes:
    """`frames` `[T, H, W, 3]` uint8 (a tensor or array) -> an MP4 (H.264, yuv420p, `fps` frames per second).

    Odd sides are padded by one edge pixel (4:2:0 chroma needs even ones).
    """
    writer = Mp4Writer(fps, crf=crf)
    writer.add(frames)
    return writer.close()
