"""The chaos benchmark's driver: the `mstar serve` subprocess and its workers, and a client that records every request.

Used by benchmarks/chaos.py and benchmarks/soak.py; everything goes to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
WORKER_MODULE = "mstar_core.cluster.worker"
WORKER_INFO = "mstar_worker_info"  # on /metrics: one sample per live worker, its pid a label
_SERVERS: list[Server] = []  # stopped at exit whatever happened
_STALL = re.compile(r"event loop held (\d+) ms \(([\w-]+)\); where \(samples\): (.*)")  # loop_watch.py's line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_state(pid: int) -> str | None:
    """The process's state letter (R, S, T, Z, ...) or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    return proc_state(pid) not in (None, "Z", "X")


def start_time(pid: int) -> int | None:
    """When the process started (clock ticks since boot): with its pid, names one process, never a later reuse."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def worker_info(text: str) -> dict[str, int] | None:
    """Worker pids by name from a /metrics exposition's `mstar_worker_info` on this host; None if it has none."""
    if f"# TYPE {WORKER_INFO} " not in text:  # a server without it, or one serving everything in-process
        return None
    lines = [line for line in text.splitlines() if line.startswith((f"{WORKER_INFO}{{", f"# TYPE {WORKER_INFO} "))]
    host = socket.gethostname()
    return {s.labels["worker"]: int(s.labels["pid"]) for family in text_string_to_metric_families("\n".join(lines) + "\n")
            for s in family.samples if s.name == WORKER_INFO and s.labels.get("host") == host}


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return out


class StartError(RuntimeError):
    """A server exited or never became healthy."""


class Server:
    """One `mstar serve MODELS` subprocess (orpheus unless told) and the worker processes it spawns."""

    def __init__(self, label: str, extra: list[str], models: tuple[str, ...] = ("orpheus",),
                 env: dict[str, str] | None = None):
        self.label = label
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"mstar-chaos-{label}-", suffix=".log", delete=False)
        # workers start as users' do (forks of the worker zygote): they are found by the pid /metrics gives them
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        env.pop("MSTAR_API_KEY", None)
        cmd = [sys.executable, "-m", "mstar_core.cli", "serve", *models, "--host", "127.0.0.1",
               "--port", str(self.port), "--log-level", "warning", *extra]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        self.ready_s: float | None = None
        self.ready: asyncio.Future | None = None  # wait_ready(), started at once so ready_s is when it was
        self.seen: dict[int, tuple[str, int | None]] = {}  # every worker pid ever seen -> (its name, start time)
        self.found_by = "none"  # how workers() last found them: "metrics" or "command line"
        self._scraper = httpx.Client(base_url=self.url, trust_env=False, timeout=2.0)
        _SERVERS.append(self)

    def workers(self) -> dict[str, int]:
        """Live worker processes by name: the server's `mstar_worker_info` on /metrics, else `--name` on their
        command line (fresh interpreters only: a fork of the worker zygote carries the zygote's)."""
        try:
            named = worker_info(self._scraper.get("/metrics").text)
        except (httpx.HTTPError, RuntimeError):  # not answering, or this client closed already
            named = None
        self.found_by = "metrics" if named is not None else "command line"
        if named is None:
            named = {}
            for pid in children(self.proc.pid):
                args = cmdline(pid)
                if WORKER_MODULE in args and "--name" in args:
                    named[args[args.index("--name") + 1]] = pid
        out = {name: pid for name, pid in named.items() if alive(pid)}  # the server may not have seen a death yet
        for name, pid in out.items():
            self.seen[pid] = (name, start_time(pid))
        return out

    def ours(self, pid: int) -> bool:
        """`pid` is still a worker process this server spawned (seen earlier, not a later process reusing its pid)."""
        return pid in self.seen and alive(pid) and start_time(pid) == self.seen[pid][1]

    async def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(base_url=self.url, trust_env=False, timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise StartError(f"server exited with code {self.proc.returncode}:\n{self.tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get("/health")).status_code == 200:
                        self.ready_s = time.monotonic() - self.started
                        self.workers()
                        return
                await asyncio.sleep(0.2)
        raise StartError(f"server not healthy within {timeout:.0f}s:\n{self.tail()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def loop_stalls(self, since: int = 0) -> list[tuple[int, str, str]]:
        """(milliseconds, cause, where) of each event-loop stall the server logged after character `since` of its
        log (started with MSTAR_LOOP_WATCH_MS: mstar_core/api/server/loop_watch.py; cause: computing, gil, no-cpu)."""
        return [(int(m.group(1)), m.group(2), m.group(3)) for m in _STALL.finditer(self.output()[since:])]


    def tail(self, lines: int = 12) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    def stop(self, grace: float = 15.0) -> int | None:
        """SIGINT (the server's clean drain), then SIGKILL; then any worker of ours still alive."""
        if self.proc.poll() is None:
            self.workers()
            for pid in self.seen:
                if self.ours(pid) and proc_state(pid) == "T":
                    os.kill(pid, signal.SIGCONT)
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self.seen:
            if self.ours(pid):  # never some other process that got the pid since
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        return self.proc.returncode

    def close(self, keep_log: bool) -> None:
        self._scraper.close()
        self.log.close()
        if not keep_log:
            with contextlib.suppress(OSError):
                os.unlink(self.log.name)


# ---------------------------------------------------------------------------------------------
# requests


@dataclass
class Rec:
    kind: str  # healthy | probe | poison
    name: str
    t_start: float
    job: tuple | None = None
    t_headers: float | None = None
    t_first_byte: float | None = None
    t_end: float | None = None
    status: int | None = None
    outcome: str = "running"  # ok | short | bad_wav | http_NNN | broken_stream | error_event | timeout | accepted
    detail: str = ""
    samples: int | None = None
    retry_after: float | None = None  # seconds, from a Retry-After header

    @property
    def t_fail(self) -> float | None:
        if self.outcome == "ok":
            return None
        return self.t_headers if self.status not in (None, 200) else self.t_end


def wav_samples(data: bytes, rate: int, exact: bool) -> int | None:
    """Samples in a 44-byte-header PCM s16le mono WAV, or None if the header or length is wrong."""
    if len(data) < 44 or data[:4] != b"RIFF" or data[8:12] != b"WAVE" or data[12:16] != b"fmt " \
            or data[36:40] != b"data":
        return None
    fmt, channels, sample_rate, _, _, bits = struct.unpack("<HHIIHH", data[20:36])
    size = struct.unpack("<I", data[40:44])[0]
    payload = len(data) - 44
    if (fmt, channels, sample_rate, bits) != (1, 1, rate, 16) or payload % 2:
        return None
    if exact and size != payload:
        return None
    if not exact and size not in (payload, 0xFFFFFFFF):
        return None
    return payload // 2


class Driver:
    """Sends requests to one server and records every one of them (times relative to `t0`)."""

    def __init__(self, server: Server, timeout: float, connections: int = 64):
        self.server = server
        self.timeout = timeout
        self.client = httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=httpx.Timeout(timeout + 5),
                                        limits=httpx.Limits(max_connections=connections,
                                                            max_keepalive_connections=min(16, connections)))
        self.t0 = time.monotonic()
        self.records: list[Rec] = []
        self.reference: dict[tuple, int] = {}
        self.rate = 24000
        self.tasks: set[asyncio.Task] = set()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def speech(self, kind: str, name: str, job: tuple, *, stream: bool = True,
                     timeout: float | None = None) -> Rec:
        text, seed, max_tokens = job
        body = {"model": "orpheus", "input": text, "voice": "tara", "seed": seed, "max_tokens": max_tokens,
                "response_format": "wav", "stream": stream}
        rec = Rec(kind, name, self.now(), job=job)
        self.records.append(rec)
        data = await self._send(rec, "/v1/audio/speech", body, timeout or self.timeout)
        if rec.outcome == "done":
            samples = wav_samples(data, self.rate, exact=not stream)
            rec.samples = samples
            want = self.reference.get(job)
            if samples is None:
                rec.outcome, rec.detail = "bad_wav", f"{len(data)} bytes: {data[:48]!r}"
            elif want is not None and samples != want:
                rec.outcome, rec.detail = "short", f"{samples} samples, reference {want}"
            else:
                rec.outcome = "ok"
        return rec

    async def poison(self, name: str, path: str, body: Any) -> Rec:
        rec = Rec("poison", name, self.now())
        self.records.append(rec)
        data = await self._send(rec, path, body)
        if rec.outcome == "done":
            if path.startswith("/v1/walks/"):
                lines = [json.loads(line) for line in data.splitlines() if line.strip()]
                events = [e.get("event") for e in lines]
                rec.outcome = "error_event" if "error" in events else "accepted" if "done" in events else "broken_stream"
                rec.detail = next((json.dumps(e)[:300] for e in lines if e.get("event") == "error"), "")
            else:
                rec.outcome = "accepted"  # a 200 with audio: the poison was served, not refused
        return rec

    async def _send(self, rec: Rec, path: str, body: Any, timeout: float | None = None) -> bytes:
        """Stream one POST; sets status/outcome ('done' = complete 200 body, checked by the caller)."""
        kwargs: dict[str, Any] = {"content": body, "headers": {"Content-Type": "application/json"}} \
            if isinstance(body, bytes) else {"json": body}
        buf = bytearray()
        try:
            async with asyncio.timeout(timeout or self.timeout):
                async with self.client.stream("POST", path, **kwargs) as r:
                    rec.t_headers, rec.status = self.now(), r.status_code
                    with contextlib.suppress(ValueError):
                        rec.retry_after = float(r.headers.get("retry-after", ""))
                    if r.status_code != 200:
                        rec.outcome = f"http_{r.status_code}"
                        rec.detail = (await r.aread()).decode(errors="replace")[:300]
                        return b""
                    async for chunk in r.aiter_raw():
                        if chunk and rec.t_first_byte is None:
                            rec.t_first_byte = self.now()
                        buf += chunk
            rec.outcome = "done"
        except TimeoutError:
            rec.outcome, rec.detail = "timeout", f"no complete answer within {timeout or self.timeout:.0f}s"
        except httpx.HTTPError as exc:
            rec.outcome, rec.detail = "broken_stream", f"{type(exc).__name__}: {exc}"[:300]
        finally:
            rec.t_end = self.now()
        return bytes(buf)

    def in_flight(self, kinds=("healthy", "probe")) -> list[Rec]:
        return [r for r in self.records if r.kind in kinds and r.t_end is None]

    def first_success_after(self, t: float) -> float | None:
        ends = [r.t_end for r in self.records
                if r.kind in ("healthy", "probe") and r.outcome == "ok" and r.t_start > t and r.t_end is not None]
        return min(ends) if ends else None

    async def close(self) -> None:
        await self.client.aclose()


async def references(drv: Driver, jobs: list[tuple]) -> None:
    """Non-streamed sample counts of every job, before any fault or poison (all at once: counts do not
    depend on batching)."""
    # not a measurement: a generous timeout (a busy machine, another server starting) and one retry
    timeout = max(60.0, 4 * drv.timeout)
    recs = await asyncio.gather(*(drv.speech("reference", "reference", job, stream=False, timeout=timeout)
                                  for job in jobs))
    for job, rec in zip(jobs, recs, strict=True):
        if rec.outcome != "ok" or rec.samples is None:
            rec = await drv.speech("reference", "reference", job, stream=False, timeout=timeout)
        if rec.outcome != "ok" or rec.samples is None:
            raise RuntimeError(f"reference request {job} failed: {rec.outcome} {rec.detail}")
        drv.reference[job] = rec.samples
    drv.records.clear()


async def traffic(drv: Driver, jobs: list[tuple], loop: int, loops: int, stop: asyncio.Event, max_requests: int):
    """One client loop: healthy streamed requests back to back until `stop` (bounded by `max_requests`)."""
    for n in range(max_requests):
        if stop.is_set():
            return
        job = jobs[(loop + n * loops) % len(jobs)]
        rec = await drv.speech("healthy", f"job{jobs.index(job)}", job)
        if rec.outcome != "ok":  # a client that backs off: Retry-After (at most 2 s) when given, else 0.5 s
            await asyncio.sleep(min(rec.retry_after, 2.0) if rec.retry_after is not None else 0.5)


async def wait_mid_stream(drv: Driver, count: int, limit: float) -> int:
    """Wait (up to `limit` s) until `count` healthy requests are streaming audio; returns how many are."""
    deadline = time.monotonic() + limit
    while True:
        n = sum(1 for r in drv.in_flight(("healthy",)) if r.t_first_byte is not None)
        if n >= count or time.monotonic() > deadline:
            return n
        await asyncio.sleep(0.05)


async def send_poisons(drv: Driver, items: list[tuple[str, str, Any]], gap: float) -> list[asyncio.Task]:
    tasks = []
    for name, path, body in items:
        await wait_mid_stream(drv, 2, 3.0)
        tasks.append(drv.spawn(drv.poison(name, path, body)))
        await asyncio.sleep(gap)
    return tasks



def rss_mb(pid: int) -> float | None:
    """Resident memory of a process in MB (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return None


@atexit.register
def _stop_all() -> None:
    for server in _SERVERS:
        with contextlib.suppress(Exception):
            server.stop(grace=5.0)


def stall_figures(stalls: list[tuple[int, str, str]], prefix: str) -> dict[str, Any]:
    """The slowest loop stall of each cause (0: none over the watch's threshold). `computing` and `gil` are the
    server's own (its loop thread ran, or its other threads held the interpreter); `no-cpu` is the machine's load."""
    out = {f"{prefix}_loop_stall_max_ms": max((ms for ms, _, _ in stalls), default=0)}
    for cause in ("computing", "gil", "no-cpu"):
        out[f"{prefix}_loop_{cause.replace('-', '_')}_max_ms"] = max((ms for ms, c, _ in stalls if c == cause),
                                                                     default=0)
    return out


_PROBE = r"""
import http.client, sys, time
host, port = sys.argv[1], int(sys.argv[2])
conn = None
while True:
    t0 = time.monotonic()
    try:
        if conn is None:
            conn = http.client.HTTPConnection(host, port, timeout=30)
        conn.request("GET", "/health")
        conn.getresponse().read()
    except (OSError, http.client.HTTPException):
        conn = None
    print(f"{t0:.6f} {time.monotonic() - t0:.6f}", flush=True)
    time.sleep(0.05)
"""


class HealthProbe:
    """`GET /health` every 50 ms from a process of its own (keep-alive, stdlib client): its figures are the server's
    and the machine's, not the benchmark's (whose own loop serializes megabytes of stress payloads meanwhile).
    `samples()`: (when it was asked, seconds to the answer) in time.monotonic(), which processes share on Linux."""

    def __init__(self, host: str, port: int):
        self.proc = subprocess.Popen([sys.executable, "-c", _PROBE, host, str(port)], stdout=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, text=True)
        atexit.register(self._end)  # whatever happens to the stress

    def _end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> list[tuple[float, float]]:
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=30)
        return [(float(a), float(b)) for a, b in (line.split() for line in out.splitlines() if line.count(" ") == 1)]
