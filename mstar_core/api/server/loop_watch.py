"""`LoopWatch`: finds what holds the event loop. Opt-in (`MSTAR_LOOP_WATCH_MS`), for diagnosis and benchmarks.

A heartbeat callback on the loop stamps the time every few milliseconds; a daemon thread looks at the stamp and,
while it is older than the threshold, samples the loop thread's stack (`sys._current_frames()`). When the loop
runs again, one WARNING line names the stall's length, its cause (`stall_cause`: the loop computing, waiting for the
GIL other threads held, or the process without a core) and the frames seen most often in it, innermost first: the
code that held the loop, not only the task it belonged to (what asyncio's debug mode would name).

The sampler needs the GIL to look, so a stall inside one long C call (a JSON parse of megabytes) is seen as the
frame that made the call, as soon as the call returns or releases the GIL; a stall caused by other threads
holding the GIL shows as the loop thread waiting in its selector or a lock.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import sys
import threading
import time
import traceback

log = logging.getLogger("mstar.api.loop")

#: The environment variable that turns the watch on: the stall threshold in milliseconds.
ENV = "MSTAR_LOOP_WATCH_MS"
#: Frames kept of each sample (innermost), and samples taken per second of a stall.
FRAMES = 6
BEAT_S = 0.005


class LoopWatch:
    """Logs each stall of `loop` longer than `threshold_s`, with where the loop thread was meanwhile."""

    def __init__(self, loop: asyncio.AbstractEventLoop, threshold_s: float):
        self.loop = loop
        self.threshold_s = threshold_s
        self.stalls: list[tuple[float, str]] = []  # (seconds, where), the last 1,000
        self._beat = time.monotonic()
        self._stop = threading.Event()
        self._loop_thread = threading.get_ident()  # made on the loop's thread (see `start`)
        self._loop_native_id = threading.get_native_id()
        self._thread = threading.Thread(target=self._watch, name="mstar-loop-watch", daemon=True)

    @classmethod
    def from_env(cls) -> LoopWatch | None:
        """A started watch if the environment asks for one (call on the loop's thread)."""
        raw = os.environ.get(ENV, "").strip()
        if not raw:
            return None
        try:
            threshold_ms = float(raw)
        except ValueError:
            log.warning("%s=%r is not a number of milliseconds: the loop watch is off", ENV, raw)
            return None
        if not threshold_ms > 0:
            log.warning("%s must be above 0: the loop watch is off", ENV)
            return None
        watch = cls(asyncio.get_running_loop(), threshold_ms / 1000)
        watch.start()
        return watch

    def start(self) -> None:
        self._loop_thread = threading.get_ident()
        self._loop_native_id = threading.get_native_id()
        self.loop.call_soon(self._tick)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _tick(self) -> None:
        self._beat = time.monotonic()
        if not self._stop.is_set():
            self.loop.call_later(BEAT_S, self._tick)

    def _watch(self) -> None:
        samples: collections.Counter[str] = collections.Counter()
        busy: collections.Counter[str] = collections.Counter()  # other threads seen running Python meanwhile
        stalled_since: float | None = None
        cpu_at = (0.0, 0.0)
        while not self._stop.wait(BEAT_S):
            beat = self._beat
            late = time.monotonic() - beat
            if late > self.threshold_s:
                if stalled_since is None:
                    stalled_since, cpu_at = beat, (self._loop_cpu_s(), time.process_time())
                frames = sys._current_frames()
                frame = frames.get(self._loop_thread)
                if frame is not None:
                    samples[_where(frame)] += 1
                for ident, other in frames.items():
                    if ident not in (self._loop_thread, threading.get_ident()) and not _idle(other):
                        busy[_where(other, 3)] += 1
            elif stalled_since is not None:
                held = beat - stalled_since
                loop_cpu, process_cpu = self._loop_cpu_s() - cpu_at[0], time.process_time() - cpu_at[1]
                where = " | ".join(f"{n}x {w}" for w, n in samples.most_common(3))
                others = " | ".join(f"{n}x {w}" for w, n in busy.most_common(3))
                cause = stall_cause(held, loop_cpu, process_cpu)
                self.stalls = [*self.stalls[-999:], (held, f"{cause}: {where}")]
                log.warning("event loop held %.0f ms (%s); where (samples): %s; loop thread CPU %.0f ms, process CPU "
                            "%.0f ms; other threads running Python: %s", held * 1000, cause, where or "-",
                            loop_cpu * 1000, process_cpu * 1000, others or "-")
                samples.clear()
                busy.clear()
                stalled_since = None

    def _loop_cpu_s(self) -> float:
        """CPU seconds the loop's thread has used (Linux: its /proc task; elsewhere 0)."""
        try:
            with open(f"/proc/self/task/{self._loop_native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / _TICKS
        except (OSError, IndexError, ValueError):
            return 0.0


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
#: Innermost functions of a thread that waits (for work, a lock, a socket): not what holds the GIL.
_IDLE = frozenset({"wait", "_wait_for_tstate_lock", "get", "select", "poll", "accept", "recv", "recv_into", "sleep",
                   "_worker", "read", "readinto", "_recv", "_recv_bytes", "wait_for", "run_forever", "_poll"})


def _idle(frame) -> bool:
    return frame.f_code.co_name in _IDLE


def stall_cause(held_s: float, loop_cpu_s: float, process_cpu_s: float) -> str:
    """Why the loop did not run, from CPU times over the stall: `computing` (the loop thread ran for half of it or
    more: its frames are the culprit), `gil` (other threads of the process ran for half of it or more while the loop
    waited: the interpreter lock they held), else `no-cpu` (the process got little of a core: the machine's load).
    The loop thread's time comes in clock ticks (10 ms), so a stall of a few ticks is classed coarsely."""
    if loop_cpu_s >= held_s / 2:
        return "computing"
    if process_cpu_s - loop_cpu_s >= held_s / 2:
        return "gil"
    return "no-cpu"


def _where(frame, depth: int = FRAMES) -> str:
    stack = traceback.extract_stack(frame)[-depth:]
    return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack))
