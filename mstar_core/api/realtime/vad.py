"""Server voice-activity detection for realtime sessions: speech start and stop over a 24 kHz pcm16 stream.

Two detectors share one turn-taking state machine (`TurnDetector`):

- `SileroScorer` (the `silero-vad` package, whose model ships inside it; used when it imports): a speech
  probability per 32 ms window of 16 kHz audio, compared with the session's `threshold` (0..1).
- `EnergyScorer` (no dependency; `MSTAR_REALTIME_VAD=energy` forces it): a 20 ms frame counts as speech when
  its RMS level in dBFS is above `-70 + 60 * threshold` (threshold 0.5: -40 dBFS; 0.0: -70; 1.0: -10) *and*
  10 dB above the tracked noise floor (the floor follows quiet frames down at once and rises 0.5 dB a frame),
  so a steady hum above the threshold is not speech forever.

Speech starts after `start_ms` (60 ms) of speech frames; `audio_start_ms` is where those began. It stops after
`silence_duration_ms` of non-speech frames; `audio_end_ms` is the end of the last speech frame. The committed
turn is the audio from `audio_start_ms - prefix_padding_ms` to `audio_end_ms` (OpenAI's server VAD semantics).

With `pause_ms` set, the detector also reports a pause in the speech: `paused` after `pause_ms` of silence (its
`ms` is the `audio_end_ms` a stop would have, should the silence last), `resumed` when speech comes back before
the stop. A session starts its reply at the pause (preemptive generation) and keeps or drops it at the stop.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import attrs
import numpy as np

log = logging.getLogger("mstar.api.realtime")
RATE = 24_000


class EnergyScorer:
    """Speech scores per 20 ms frame from the level and a tracked noise floor (1.0 speech, 0.0 not)."""

    frame = RATE // 50

    def __init__(self, threshold: float):
        self.level_db = -70.0 + 60.0 * threshold
        self.floor_db = -90.0

    def score(self, frame: np.ndarray) -> float:
        rms = float(np.sqrt(np.mean(np.square(frame.astype(np.float64) / 32768.0)))) if frame.size else 0.0
        db = 20.0 * np.log10(max(rms, 1e-6))
        speech = db > self.level_db and db > self.floor_db + 10.0
        # the floor tracks quiet frames at once and creeps up through loud ones (a hum lifts it; speech is short)
        self.floor_db = db if db < self.floor_db else self.floor_db + 0.5
        return 1.0 if speech else 0.0

    def threshold(self) -> float:
        return 0.5


class SileroScorer:
    """Silero VAD's speech probability per 32 ms (512 samples at 16 kHz, 768 at 24 kHz)."""

    frame = 768

    def __init__(self, threshold: float, model: object):
        self._threshold = threshold
        self.model = model
        self.model.reset_states()

    def score(self, frame: np.ndarray) -> float:
        import torch

        from mstar_core.api.media import resample

        pcm16k = resample(frame.astype(np.float32) / 32768.0, RATE, 16_000)[:512]
        if pcm16k.size < 512:
            pcm16k = np.pad(pcm16k, (0, 512 - pcm16k.size))
        with torch.no_grad():
            return float(self.model(torch.from_numpy(pcm16k), 16_000).item())

    def threshold(self) -> float:
        return self._threshold


_silero_model: object | None = None


_silero_lock = threading.Lock()


def silero_model() -> object | None:
    """The packaged Silero model (loaded once, offline), or None when `silero-vad` is not installed or fails."""
    global _silero_model
    if _silero_model is None:
        with _silero_lock:  # loaded in a thread (`silero_pending`) while another may ask for it
            if _silero_model is None:
                try:
                    from silero_vad import load_silero_vad

                    _silero_model = load_silero_vad()
                except Exception as exc:  # not installed, or a torch it cannot load under: the energy detector
                    log.info("silero-vad unavailable (%s: %s); using the energy detector", type(exc).__name__, exc)
                    _silero_model = False
    return _silero_model or None


def silero_pending() -> bool:
    """Whether the Silero model is wanted and not loaded yet: its first load takes a second or more (importing and
    scripting it), so a caller on the event loop loads it in a thread first (`asyncio.to_thread(silero_model)`)."""
    return _silero_model is None and os.environ.get("MSTAR_REALTIME_VAD", "auto").strip().lower() != "energy"


def make_scorer(threshold: float) -> EnergyScorer | SileroScorer:
    """The detector `MSTAR_REALTIME_VAD` names (`silero`, `energy`; default: silero when it loads)."""
    wanted = os.environ.get("MSTAR_REALTIME_VAD", "auto").strip().lower()
    if wanted != "energy":
        model = silero_model()
        if model is not None:
            import copy

            return SileroScorer(threshold, copy.deepcopy(model))  # its recurrent state is per session
    return EnergyScorer(threshold)


@attrs.frozen
class VadEvent:
    """`kind` is "started" or "stopped"; times in ms from the start of the input audio stream."""

    kind: str  # started | stopped | paused | resumed (the last two only with `pause_ms`)
    ms: int


@attrs.define
class TurnDetector:
    """Feeds pcm16 samples, returns speech start/stop events (see the module docstring)."""

    threshold: float = 0.5
    silence_duration_ms: int = 500
    prefix_padding_ms: int = 300
    start_ms: int = 60
    scorer_factory: Callable[[float], object] = make_scorer
    scorer: object = None
    pending: np.ndarray = attrs.field(factory=lambda: np.zeros(0, dtype=np.int16))
    position: int = 0  # samples scored so far
    speaking: bool = False
    run_start: int | None = None  # first sample of the current run of speech frames
    last_speech_end: int = 0
    silence: int = 0  # samples of non-speech since the last speech frame
    pause_ms: int | None = None  # report a pause after this much silence (None: never)
    paused: bool = False  # a pause was reported and neither speech nor the stop has followed yet

    def __attrs_post_init__(self) -> None:
        if self.scorer is None:
            self.scorer = self.scorer_factory(self.threshold)

    def feed(self, pcm: np.ndarray) -> list[VadEvent]:
        events: list[VadEvent] = []
        data = np.concatenate([self.pending, pcm.astype(np.int16, copy=False)])
        n = self.scorer.frame
        used = (data.size // n) * n
        for start in range(0, used, n):
            frame = data[start : start + n]
            at = self.position
            self.position += n
            speech = self.scorer.score(frame) >= self.scorer.threshold()
            if speech:
                if self.paused:
                    self.paused = False
                    events.append(VadEvent("resumed", at * 1000 // RATE))
                self.silence = 0
                self.last_speech_end = self.position
                if self.run_start is None:
                    self.run_start = at
                if not self.speaking and self.position - self.run_start >= self.start_ms * RATE // 1000:
                    self.speaking = True
                    events.append(VadEvent("started", self.run_start * 1000 // RATE))
            else:
                if not self.speaking:
                    self.run_start = None
                    continue
                self.silence += n
                if self.silence >= self.silence_duration_ms * RATE // 1000:
                    self.speaking, self.run_start, self.silence, self.paused = False, None, 0, False
                    events.append(VadEvent("stopped", self.last_speech_end * 1000 // RATE))
                elif (self.pause_ms is not None and not self.paused
                      and self.silence >= self.pause_ms * RATE // 1000):
                    self.paused = True
                    events.append(VadEvent("paused", self.last_speech_end * 1000 // RATE))
        self.pending = data[used:].copy()
        return events

    def reset(self, position: int = 0) -> None:
        """Forget any speech in progress (the buffer was cleared or committed by the client)."""
        self.pending = np.zeros(0, dtype=np.int16)
        self.position, self.speaking, self.run_start, self.silence, self.paused = position, False, None, 0, False
