"""Transcripts of a speech-recognition model (`transcriptions` / `translations` adapters) and OpenAI's response formats.

An adapter that serves route `transcriptions` turns an upload into its model's inputs (`transcription_inputs`) and the
model's tokens into a `Transcript` (segments with times, average log-probability, compression ratio and no-speech
probability; words with times when asked); this module shapes it as `json`, `text`, `srt`, `vtt` or `verbose_json`, and decides Whisper's
temperature fallback (openai-whisper's thresholds: a window is decoded again, hotter, when its text compresses too
well or its tokens are too unlikely).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import attrs

FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
#: openai-whisper's and faster-whisper's defaults
TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
COMPRESSION_RATIO_THRESHOLD = 2.4
LOG_PROB_THRESHOLD = -1.0
NO_SPEECH_THRESHOLD = 0.6


def compression_ratio(text: str) -> float:
    """UTF-8 bytes over their zlib-compressed size (repetitive, looping text compresses well)."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


@attrs.frozen
class Segment:
    id: int
    start: float
    end: float
    text: str
    tokens: tuple[int, ...]
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    temperature: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "seek": 0, "start": round(self.start, 2), "end": round(self.end, 2), "text": self.text,
                "tokens": list(self.tokens), "temperature": self.temperature, "avg_logprob": self.avg_logprob,
                "compression_ratio": self.compression_ratio, "no_speech_prob": self.no_speech_prob}


@attrs.frozen
class TimedWord:
    """A word of the transcript and when it is spoken (seconds into the audio), for verbose_json's `words`."""

    word: str
    start: float
    end: float

    def as_json(self) -> dict[str, Any]:
        return {"word": self.word, "start": round(self.start, 2), "end": round(self.end, 2)}


@attrs.frozen
class Transcript:
    text: str
    language: str
    duration: float
    segments: tuple[Segment, ...]
    avg_logprob: float
    no_speech_prob: float
    temperature: float = 0.0
    words: tuple[TimedWord, ...] | None = None  # None: word timestamps were not asked for

    @property
    def compression_ratio(self) -> float:
        return compression_ratio(self.text)

    def needs_fallback(self) -> bool:
        """openai-whisper's rule: decode again (hotter) when the text loops or its tokens are unlikely, unless the
        window is silence (no speech likely and the tokens unlikely too)."""
        if self.no_speech_prob > NO_SPEECH_THRESHOLD and self.avg_logprob < LOG_PROB_THRESHOLD:
            return False
        return self.compression_ratio > COMPRESSION_RATIO_THRESHOLD or self.avg_logprob < LOG_PROB_THRESHOLD


def _clock(seconds: float, separator: str) -> str:
    ms = int(round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{separator}{ms:03d}"


def srt(segments: Sequence[Segment]) -> str:
    return "".join(f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text.strip()}\n\n"
                   for i, s in enumerate(segments, 1))


def vtt(segments: Sequence[Segment]) -> str:
    return "WEBVTT\n\n" + "".join(f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text.strip()}\n\n"
                                  for s in segments)


def verbose_json(transcript: Transcript, task: str) -> dict[str, Any]:
    body = {"task": task, "language": transcript.language, "duration": transcript.duration, "text": transcript.text,
            "segments": [s.as_json() for s in transcript.segments],
            "usage": {"type": "duration", "seconds": transcript.duration}}
    if transcript.words is not None:
        body["words"] = [w.as_json() for w in transcript.words]
    return body
