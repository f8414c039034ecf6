"""Whisper's sequential long-form: the two `function` nodes of the window loop and the split of a window's tokens.

Each round decodes the log-mel frames `[seek, seek + 3000)` of the whole clip (zero-padded), then splits its tokens
into segments at consecutive timestamps; `seek` advances by the whole window when the output ends in a lone timestamp
or has no timestamp pair, otherwise to the last pair's first timestamp (its tail is decoded again next round).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

#: mel frames per encoder position (the second convolution's stride) and seconds per mel frame
INPUT_STRIDE, FRAME_SECONDS = 2, 0.01


@attrs.frozen
class WindowSplit:
    segments: tuple[tuple[float, float, tuple[int, ...]], ...]  # (start s, end s, tokens incl. their timestamps)
    advance: int  # mel frames the next window starts after this one's start


def split_window(tokens: list[int], timestamp_begin: int, eot: int, offset: float, frames: int) -> WindowSplit:
    """A window's generated tokens (`offset` seconds in, `frames` real mel frames) as transformers splits them."""
    seq = tokens[:-1] if tokens and tokens[-1] == eot else list(tokens)
    is_ts = [t >= timestamp_begin for t in seq]
    single_ending = is_ts[-2:] == [False, True]
    cuts = [i + 1 for i in range(len(is_ts) - 1) if is_ts[i] and is_ts[i + 1]]
    if not cuts:
        last = frames * FRAME_SECONDS
        stamps = [t for t in seq if t >= timestamp_begin]
        if stamps and stamps[-1] != timestamp_begin:
            last = (stamps[-1] - timestamp_begin) * 0.02
        return WindowSplit(((offset, offset + last, tuple(seq)),), frames)
    cuts = cuts + [len(seq)] if single_ending else cuts[:-1] + [cuts[-1] + 1]
    segments, start = [], 0
    for i, cut in enumerate(cuts):
        part = seq[start:cut]
        end_at = -1 if i < len(cuts) - 1 or single_ending else -2
        segments.append((offset + (part[0] - timestamp_begin) * 0.02, offset + (part[end_at] - timestamp_begin) * 0.02,
                         tuple(part)))
        start = cut
    advance = frames if single_ending else (seq[start - 2] - timestamp_begin) * INPUT_STRIDE
    return WindowSplit(tuple(segments), advance)


class WindowFeatures:
    """`mel [n_mels, N]`, `seek` -> the window's `[n_mels, 3000]` features (zero-padded past the clip), its real
    frames and its time offset."""

    def __init__(self, frames: int = 3000):
        self.frames = frames

    def __call__(self, mel: torch.Tensor, seek: int, max_frames: int) -> dict[str, Any]:
        real = min(self.frames, max_frames - seek)
        window = mel[:, seek : seek + real]
        window = torch.nn.functional.pad(window, (0, self.frames - window.shape[1]))
        return {"input_features": window, "seek_frames": real, "time_offset": seek * FRAME_SECONDS}


class SeekNext:
    """A window's tokens (prefill's first, then the decode loop's) -> its segments and where the next one starts."""

    def __init__(self, timestamp_begin: int, eot: int):
        self.timestamp_begin, self.eot = timestamp_begin, eot

    def __call__(self, first_token: int, window_tokens: list[int], seek: int, seek_frames: int,
                 time_offset: float) -> dict[str, Any]:
        tokens = [first_token, *window_tokens]
        split = split_window(tokens, self.timestamp_begin, self.eot, time_offset, seek_frames)
        return {"next_seek": seek + split.advance,
                "window_result": {"tokens": tokens, "segments": split.segments, "offset": time_offset}}
