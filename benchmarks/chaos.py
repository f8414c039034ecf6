"""Fault isolation under chaos: poisoned requests, `kill -9` and `SIGSTOP` of workers, behind the real HTTP server.

Two real `mstar serve orpheus` processes (tiny preset) on free loopback ports: colocated (one
process) and disaggregated (`examples/placement/orpheus-disaggregated.yaml`: the LM and the SNAC
codec each in a worker process). Against each, a few client loops (bounded concurrency) stream
/v1/audio/speech back to back (after a failure a loop waits Retry-After, at most 2 s, or 0.5 s)
while poisoned requests are mixed in: `seed` 1.5, 2**64, "abc", Infinity, `temperature: 1e-320`
with and without `top_p: 0.5`, and through /v1/walks/orpheus (when the server has that route)
`seed: 1.5` and `logprobs: 10**9`. On the disaggregated server each worker is then `kill -9`ed
in turn and one is `SIGSTOP`ped: round 1 stops the LM's worker, kills it, kills the codec's;
round 2 kills the LM's, kills the codec's, stops the codec's (rounds alternate; the codec's faults
come last so that the final page count sees what they left on the LM's worker). A stopped worker
that supervision has not killed within `--stop-window` seconds is sent `SIGCONT`.

Rules (what the figures count):
  * full output: HTTP 200, the chunked body received to its end, a 44-byte PCM s16le mono WAV
    header, and as many samples as the reference for the same (text, voice, seed, max_tokens):
    a non-streamed (`stream: false`) request made on the same server before any fault or poison.
    (Sample counts do not depend on batching; sample values may, so they are not compared.)
  * a request is *in flight at a fault* if it had not ended by the kill/stop and started before
    the server could know of it (the first failure of a request already running at the fault:
    a request admitted in between was routed to the dead worker, so it was on it); every request
    runs through both workers, so these are excluded from `healthy_requests_failed` whatever
    happens to them.
  * `healthy_requests_failed`: requests that are not poisoned and not in flight at a fault and did
    not end with full output. One exception: a request that started after a fault and before the
    server had recovered from it (no full-output request started after the fault had ended yet)
    and was answered with a clean 503 (status line 503, no audio) is a retryable refusal, not a
    failure. A 200 cut short, a 5xx other than 503, a short body or a timeout always counts.
    Probe requests (below) follow the same rule.
  * `max_fail_latency_s`: over every fault, the longest time from the kill/stop to a request that
    was in flight at it failing at the client (its error status line, its stream breaking off or
    ending short, or the client's timeout: counted in `in_flight_hung`). The target holds when
    every fault hit requests in flight, none hung, and each that failed did so within 1.5 s.
  * `recovery_s`: over every fault, the time from the kill/stop to the end of the first request
    started after it that finished with full output (short probe requests are sent every 0.25 s
    after a fault, up to 3 at a time, to find that moment). A `SIGSTOP` counts as recovered only if
    that happened before this script's `SIGCONT`; an unrecovered fault makes `recovery_s` null.
  * `pages_leaked`: once all requests have ended, the sum of `mstar_kv_pages_used` over every
    series `/metrics` exports (polled up to 5 s for it to reach 0). It is null (and the target
    unmet) when the KV node (`lm`) has no series, e.g. a worker's gauges are not exported.
  * `poisoned_4xx`: poisoned requests answered with a 4xx (not a 5xx, a 200, a broken stream or a
    hang), out of `poisoned_total`.

Targets: healthy_requests_failed 0, max_fail_latency_s <= 1.5, recovery_s <= 10, pages_leaked 0,
poisoned_4xx == poisoned_total. Not run in CI. `--quick`: one round, 4 client loops, shorter
requests (the disaggregated server starts while the colocated scenario runs); without it: two
rounds, 6 loops, longer requests and waits. `--no-poisons --no-faults` checks the harness itself:
every request must then finish with full output. A server that fails to start is reported
(`start_failures`) and started once more. Everything goes to 127.0.0.1; every loop is bounded in
count and time; the servers and their workers are stopped on exit (also on an exception, Ctrl-C
or SIGTERM). The last line printed is the JSON of all figures.

    python benchmarks/chaos.py --quick
"""

from __future__ import annotations

import argparse
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
PLACEMENT = REPO / "examples" / "placement" / "orpheus-disaggregated.yaml"
TARGETS = {"healthy_requests_failed": 0, "max_fail_latency_s": 1.5, "recovery_s": 10.0, "pages_leaked": 0}
TEXTS = [
    "Hey there, my name is Tara, and I speak in real time.",
    "The quick brown fox jumps over the lazy dog.",
    "How vexingly quick daft zebras jump!",
    "Streaming audio keeps the first sound early, even for long replies.",
]
PROBE = {"input": "Are you back?", "seed": 7, "max_tokens": 35}
WORKER_MODULE = "mstar_core.cluster.worker"
_SERVERS: list[Server] = []  # stopped at exit whatever happened


def poisons(has_walks: bool) -> list[tuple[str, str, Any]]:
    """(name, path, JSON body or raw bytes) of requests that must get a 4xx and hurt nobody else."""
    base = {"model": "orpheus", "input": "Poisoned, but polite.", "voice": "tara", "max_tokens": 140}
    out: list[tuple[str, str, Any]] = [
        ("speech_seed_1.5", "/v1/audio/speech", {**base, "seed": 1.5}),
        ("speech_seed_2**64", "/v1/audio/speech", {**base, "seed": 2**64}),
        ("speech_seed_abc", "/v1/audio/speech", {**base, "seed": "abc"}),
        ("speech_seed_Infinity", "/v1/audio/speech", json.dumps(base)[:-1].encode() + b', "seed": Infinity}'),
        ("speech_temperature_1e-320_top_p_0.5", "/v1/audio/speech", {**base, "temperature": 1e-320, "top_p": 0.5}),
        ("speech_temperature_1e-320", "/v1/audio/speech", {**base, "temperature": 1e-320}),
    ]
    if has_walks:
        inputs = {"text": "Poisoned, but polite.", "voice": "tara", "max_tokens": 140}
        out += [
            ("walks_seed_1.5", "/v1/walks/orpheus", {"inputs": {**inputs, "seed": 1.5}}),
            ("walks_logprobs_10**9", "/v1/walks/orpheus", {"inputs": {**inputs, "logprobs": 10**9}}),
        ]
    return out


# ---------------------------------------------------------------------------------------------
# processes


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


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


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
    """One `mstar serve orpheus` subprocess and the worker processes it spawns."""

    def __init__(self, label: str, extra: list[str]):
        self.label = label
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"mstar-chaos-{label}-", suffix=".log", delete=False)
        # workers as fresh interpreters: they are found and killed by the `--name` on their command line
        # (a fork of the worker zygote carries the zygote's)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "MSTAR_WORKER_ZYGOTE": "0"}
        env.pop("MSTAR_API_KEY", None)
        cmd = [sys.executable, "-m", "mstar_core.cli", "serve", "orpheus", "--host", "127.0.0.1",
               "--port", str(self.port), "--log-level", "warning", *extra]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        self.ready_s: float | None = None
        self.ready: asyncio.Future | None = None  # wait_ready(), started at once so ready_s is when it was
        self.seen: dict[int, str] = {}  # every worker pid ever seen -> its name
        _SERVERS.append(self)

    def workers(self) -> dict[str, int]:
        """Live worker processes by name (`--name` on their command line)."""
        out: dict[str, int] = {}
        for pid in children(self.proc.pid):
            args = cmdline(pid)
            if WORKER_MODULE in args and "--name" in args and alive(pid):
                name = args[args.index("--name") + 1]
                out[name] = pid
                self.seen[pid] = name
        return out

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

    def tail(self, lines: int = 12) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    def stop(self, grace: float = 15.0) -> int | None:
        """SIGINT (the server's clean drain), then SIGKILL; then any worker of ours still alive."""
        if self.proc.poll() is None:
            for pid in self.workers().values():
                if proc_state(pid) == "T":
                    os.kill(pid, signal.SIGCONT)
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self.seen:
            args = cmdline(pid)
            # only a worker this server spawned (its --parent-pid), never some other process reusing the pid
            if alive(pid) and WORKER_MODULE in args and str(self.proc.pid) in args:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        return self.proc.returncode

    def close(self, keep_log: bool) -> None:
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

    def __init__(self, server: Server, timeout: float):
        self.server = server
        self.timeout = timeout
        self.client = httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=httpx.Timeout(timeout + 5),
                                        limits=httpx.Limits(max_connections=64, max_keepalive_connections=16))
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


# ---------------------------------------------------------------------------------------------
# faults


@dataclass
class Fault:
    kind: str  # kill | stop
    worker: str
    pid: int
    t: float
    in_flight: list[Rec] = field(default_factory=list)
    gone_at: float | None = None
    replaced_at: float | None = None
    sigcont_at: float | None = None
    recovered_at: float | None = None
    probes: int = 0

    @property
    def detected_at(self) -> float:
        """When the server demonstrably knew of the fault: the first failure of a request in flight at it."""
        fails = [r.t_fail for r in self.in_flight if r.outcome != "ok" and r.t_fail is not None]
        return min(fails, default=self.t)


async def fault_phase(drv: Driver, kind: str, worker: str, limit: float, stop_window: float) -> Fault | dict:
    pid = drv.server.workers().get(worker)
    if pid is None:
        return {"kind": kind, "worker": worker, "error": f"no live worker process named '{worker}'"}
    await wait_mid_stream(drv, 2, 5.0)
    t = drv.now()
    os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
    fault = Fault(kind, worker, pid, t, in_flight=drv.in_flight())
    print(f"  [{drv.server.label}] t={t:6.2f}s {'kill -9' if kind == 'kill' else 'SIGSTOP'} {worker} (pid {pid}), "
          f"{len(fault.in_flight)} requests in flight", flush=True)
    probes: set[asyncio.Task] = set()
    next_probe = time.monotonic()
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        now = drv.now()
        if fault.gone_at is None and not alive(pid):
            fault.gone_at = now
        new = drv.server.workers().get(worker)
        if fault.replaced_at is None and new is not None and new != pid:
            fault.replaced_at = now
        if fault.recovered_at is None:
            fault.recovered_at = drv.first_success_after(t)
        if fault.recovered_at is not None and all(r.t_end is not None for r in fault.in_flight):
            break
        if kind == "stop" and fault.sigcont_at is None and now - t >= stop_window and proc_state(pid) == "T":
            os.kill(pid, signal.SIGCONT)
            fault.sigcont_at = now
            print(f"  [{drv.server.label}] t={now:6.2f}s supervision did not replace the stopped {worker}: SIGCONT",
                  flush=True)
        probes = {p for p in probes if not p.done()}
        if fault.recovered_at is None and len(probes) < 3 and time.monotonic() >= next_probe:
            job = (PROBE["input"], PROBE["seed"], PROBE["max_tokens"])
            probes.add(drv.spawn(drv.speech("probe", "probe", job)))
            fault.probes += 1
            next_probe = time.monotonic() + 0.25
        await asyncio.sleep(0.05)
    if kind == "stop" and proc_state(pid) == "T":  # never leave a stopped process behind
        os.kill(pid, signal.SIGCONT)
        fault.sigcont_at = fault.sigcont_at or drv.now()
    return fault


def fault_report(f: Fault | dict) -> dict:
    if isinstance(f, dict):
        return f
    failed = [r for r in f.in_flight if r.outcome != "ok" and r.t_end is not None]
    latencies = [r.t_fail - f.t for r in failed if r.t_fail is not None]
    recovered = f.recovered_at is not None and (f.sigcont_at is None or f.recovered_at <= f.sigcont_at)

    def rel(x: float | None) -> float | None:
        return None if x is None else round(x - f.t, 3)

    return {
        "kind": f.kind, "worker": f.worker, "pid": f.pid, "at_s": round(f.t, 3),
        "in_flight": len(f.in_flight),
        "in_flight_failed": len(failed),
        "in_flight_completed": sum(1 for r in f.in_flight if r.outcome == "ok"),
        "in_flight_hung": sum(1 for r in failed if r.outcome == "timeout"),
        "in_flight_outcomes": _count(r.outcome for r in f.in_flight),
        "max_fail_latency_s": round(max(latencies), 3) if latencies else None,
        "process_gone_after_s": rel(f.gone_at),
        "replaced_after_s": rel(f.replaced_at),
        "sigcont_after_s": rel(f.sigcont_at),
        "recovery_s": rel(f.recovered_at) if recovered else None,
        "recovered_only_after_sigcont": f.recovered_at is not None and not recovered,
        "success_after_s": rel(f.recovered_at),
        "probes": f.probes,
    }


def phase(r: Rec, faults: list[Fault]) -> str:
    """Which part of the run a request started in: the poisons (before any fault) or after which fault."""
    before = [f for f in faults if f.t <= r.t_start]
    return f"after {before[-1].kind} {before[-1].worker}" if before else "poisons"


def examples(failed: list[Rec], faults: list[Fault], most: int = 8) -> list[dict[str, Any]]:
    """The first failed request of each (phase, outcome), to show what went wrong where."""
    seen: dict[tuple[str, str], Rec] = {}
    for r in failed:
        seen.setdefault((phase(r, faults), r.outcome), r)
    return [{"phase": ph, "outcome": outcome, "kind": r.kind, "name": r.name, "at_s": round(r.t_start, 2),
             "status": r.status, "first_byte_s": None if r.t_first_byte is None else round(r.t_first_byte - r.t_start, 3),
             "detail": r.detail[:200]} for (ph, outcome), r in list(seen.items())[:most]]


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def classify(records: list[Rec], faults: list[Fault]) -> dict[int, str]:
    """ok | in_flight_at_fault | retryable_503 | failed, per healthy or probe request (see the docstring)."""
    out: dict[int, str] = {}
    for r in records:
        if r.kind not in ("healthy", "probe"):
            continue
        end = r.t_end if r.t_end is not None else float("inf")
        if any(r.t_start < f.detected_at and f.t < end for f in faults):
            out[id(r)] = "in_flight_at_fault"
        elif r.outcome == "ok":
            out[id(r)] = "ok"
        else:
            before = [f for f in faults if f.t <= r.t_start]
            last = before[-1] if before else None
            down = last is not None and (last.recovered_at is None or r.t_start < last.recovered_at)
            out[id(r)] = "retryable_503" if down and r.outcome == "http_503" else "failed"
    return out


# ---------------------------------------------------------------------------------------------
# metrics


async def kv_pages(drv: Driver, wait: float) -> dict[str, float]:
    """`mstar_kv_pages_used` series from /metrics, polled until they sum to 0 (or `wait` passes)."""
    deadline = time.monotonic() + wait
    series: dict[str, float] = {}
    while True:
        try:
            text = (await drv.client.get("/metrics", timeout=5.0)).text
            series = {}
            for line in text.split("\n"):
                if line.startswith("mstar_kv_pages_used{") or line.startswith("mstar_kv_pages_used "):
                    key, _, value = line.rpartition(" ")
                    series[key[len("mstar_kv_pages_used"):] or "{}"] = float(value)
        except httpx.HTTPError as exc:
            series = {"error": float("nan")}
            print(f"  /metrics failed: {exc}", flush=True)
        if (series and sum(series.values()) == 0) or time.monotonic() > deadline:
            return series
        await asyncio.sleep(0.25)


def covers(series: str, node: str) -> bool:
    """Whether a series' labels name this node (`node="lm"`, or a qualified `orpheus/lm`)."""
    values = re.findall(r'="([^"]*)"', series)
    return any(v == node or v.endswith("/" + node) for v in values)


def log_summary(text: str) -> dict[str, Any]:
    lines = text.splitlines()
    errors = [ln for ln in lines if re.search(r"\b(ERROR|CRITICAL)\b", ln)]
    return {
        "tracebacks": sum(1 for ln in lines if ln.startswith("Traceback")),
        "error_lines": len(errors),
        "first_errors": [ln[-240:] for ln in errors[:6]],
        "worker_restarts_logged": sum(1 for ln in lines if "restarted" in ln and "reloaded" in ln),
    }


# ---------------------------------------------------------------------------------------------
# scenarios


def jobs_for(quick: bool) -> list[tuple]:
    lengths = [140, 280, 210, 245] if quick else [140, 420, 210, 700, 280, 560]
    return [(TEXTS[i % len(TEXTS)], 11 + i, n) for i, n in enumerate(lengths)]


async def run_scenario(server: Server, args, *, faults_plan: list[tuple[str, str]]) -> dict[str, Any]:
    out: dict[str, Any] = {"placement": server.label}
    await server.ready
    out["server_ready_s"] = round(server.ready_s or 0.0, 2)
    out["workers"] = sorted(server.workers())
    print(f"[{server.label}] ready after {out['server_ready_s']:.1f}s (workers: {', '.join(out['workers']) or 'none'})",
          flush=True)
    drv = Driver(server, args.timeout)
    try:
        card = (await drv.client.get("/v1/models")).json()["data"]
        orpheus = next(c for c in card if c["id"] == "orpheus")
        if "speech" not in orpheus.get("routes", []):
            raise RuntimeError(f"orpheus does not serve speech here: {orpheus}")
        paths = (await drv.client.get("/openapi.json")).json().get("paths", {})
        has_walks = "/v1/walks/{model}" in paths
        jobs = jobs_for(args.quick)
        probe = (PROBE["input"], PROBE["seed"], PROBE["max_tokens"])
        t_ref = time.monotonic()
        await references(drv, [*jobs, probe])
        out["reference_s"] = round(time.monotonic() - t_ref, 2)
        out["reference_samples"] = {f"max_tokens={j[2]}": n for j, n in drv.reference.items()}
        drv.t0 = time.monotonic()

        stop = asyncio.Event()
        loops = [drv.spawn(traffic(drv, jobs, i, args.concurrency, stop, args.max_requests))
                 for i in range(args.concurrency)]
        await wait_mid_stream(drv, 2, 10.0)
        items = [] if args.no_poisons else [(name if k == 0 else f"{name} (round {k + 1})", path, body)
                                            for k in range(args.rounds) for name, path, body in poisons(has_walks)]
        poison_tasks = await send_poisons(drv, items, args.poison_gap)
        # the poison phase ends when the poisons and the healthy requests beside them have ended (each is
        # bounded by its timeout), so that no fault below hides what a poison did
        t_last = drv.now()
        await asyncio.gather(*poison_tasks, return_exceptions=True)
        beside = [r for r in drv.in_flight(("healthy",)) if r.t_start <= t_last]
        while any(r.t_end is None for r in beside):
            await asyncio.sleep(0.05)
        await asyncio.sleep(args.tail)
        out["poison_phase_s"] = round(drv.now(), 2)
        print(f"  [{server.label}] t={drv.now():6.2f}s {len(items)} poisons answered", flush=True)
        phases: list[Fault | dict] = []
        for kind, worker in faults_plan:
            # after a SIGCONT, a few more seconds show whether the server recovers then
            limit = args.stop_window + (5 if args.quick else 10) if kind == "stop" else args.kill_limit
            f = await fault_phase(drv, kind, worker, limit, args.stop_window)
            phases.append(f)
            if isinstance(f, Fault):
                rep = fault_report(f)
                print(f"  [{server.label}] t={drv.now():6.2f}s {kind} {worker}: in flight {rep['in_flight']} "
                      f"(failed {rep['in_flight_failed']}, max fail latency {rep['max_fail_latency_s']}), "
                      f"recovery {rep['recovery_s']} s, replaced after {rep['replaced_after_s']} s", flush=True)
            await asyncio.sleep(args.settle)
        if faults_plan:
            await asyncio.sleep(args.tail)
        stop.set()
        # every request is bounded by its own timeout, so this ends
        await asyncio.gather(*loops, *poison_tasks, *list(drv.tasks), return_exceptions=True)
        out["traffic_s"] = round(drv.now(), 2)
        faults = [f for f in phases if isinstance(f, Fault)]
        reports = [fault_report(f) for f in phases]

        cls = classify(drv.records, faults)
        healthy = [r for r in drv.records if r.kind in ("healthy", "probe")]
        failed = [r for r in healthy if cls[id(r)] == "failed"]
        poison_recs = [r for r in drv.records if r.kind == "poison"]
        pages = await kv_pages(drv, 5.0)
        kv_nodes = ["lm"]  # Orpheus' paged-KV node, wherever it runs
        missing = [n for n in kv_nodes if not any(covers(k, n) for k in pages)]
        out.update({
            "requests": len(healthy),
            "healthy_outcomes": _count(cls[id(r)] for r in healthy),
            "healthy_requests_failed": len(failed),
            "retryable_503_without_retry_after": sum(1 for r in healthy if cls[id(r)] == "retryable_503"
                                                     and r.retry_after is None),
            "failed_examples": examples(failed, faults),
            "failed_outcomes": _count(r.outcome for r in failed),
            "failed_by_phase": _count(phase(r, faults) for r in failed),
            "poisoned_total": len(poison_recs),
            "poisoned_4xx": sum(1 for r in poison_recs if r.status is not None and 400 <= r.status < 500),
            "poisons": {r.name: {"status": r.status, "outcome": r.outcome,
                                 "answer_s": None if r.t_end is None else round(r.t_end - r.t_start, 3),
                                 "detail": r.detail[:200]} for r in poison_recs},
            "faults": reports,
            "kv_pages_used": pages,
            "kv_gauges_missing_for": missing,
            "pages_leaked": None if missing else int(sum(pages.values())),
        })
        if faults_plan:
            out.update(fault_figures(reports))
        return out
    finally:
        for task in list(drv.tasks):
            task.cancel()
        await drv.close()


def fault_figures(reports: list[dict]) -> dict[str, Any]:
    """max_fail_latency_s / recovery_s over some faults, and whether each target holds for all of them."""
    lat = [r["max_fail_latency_s"] for r in reports if r.get("max_fail_latency_s") is not None]
    rec = [r.get("recovery_s") for r in reports]
    unrecovered = [f"{r['kind']} {r['worker']}" for r in reports if r.get("recovery_s") is None]
    measured = [r for r in reports if "error" not in r and r["in_flight"] > 0]
    return {
        "max_fail_latency_s": max(lat) if lat else None,
        "recovery_s": None if (not rec or unrecovered) else max(rec),
        "unrecovered_faults": unrecovered,
        # every fault hit requests in flight, and each of those that failed did so in time
        "fail_latency_met": bool(reports) and len(measured) == len(reports)
        and all(r["max_fail_latency_s"] is None or r["max_fail_latency_s"] <= TARGETS["max_fail_latency_s"]
                for r in measured) and all(r["in_flight_hung"] == 0 for r in measured),
        "recovery_met": bool(reports) and not unrecovered and max(rec) <= TARGETS["recovery_s"],
    }


def summarize(scenarios: dict[str, dict], wall: float, quick: bool) -> dict[str, Any]:
    ran = [s for s in scenarios.values() if "error" not in s]
    errors = {k: s["error"] for k, s in scenarios.items() if "error" in s}
    healthy_failed = sum(s["healthy_requests_failed"] for s in ran)
    figures = fault_figures([r for s in ran for r in s.get("faults", [])])
    max_lat, recovery = figures["max_fail_latency_s"], figures["recovery_s"]
    pages = [s["pages_leaked"] for s in ran]
    pages_leaked = None if (not pages or any(p is None for p in pages)) else sum(pages)
    p4 = sum(s["poisoned_4xx"] for s in ran)
    ptotal = sum(s["poisoned_total"] for s in ran)
    complete = not errors and len(ran) == len(scenarios)
    met = {
        "healthy_requests_failed": complete and healthy_failed == TARGETS["healthy_requests_failed"],
        "max_fail_latency_s": complete and figures["fail_latency_met"],
        "recovery_s": complete and figures["recovery_met"],
        "pages_leaked": complete and pages_leaked == TARGETS["pages_leaked"],
        "poisoned_4xx": complete and ptotal > 0 and p4 == ptotal,
    }
    return {
        "benchmark": "chaos",
        "quick": quick,
        "healthy_requests_failed": healthy_failed,
        "max_fail_latency_s": max_lat,
        "recovery_s": recovery,
        "pages_leaked": pages_leaked,
        "poisoned_4xx": p4,
        "poisoned_total": ptotal,
        "targets": {**TARGETS, "poisoned_4xx": "== poisoned_total"},
        "targets_met": met,
        "all_targets_met": all(met.values()),
        "scenario_errors": errors,
        "server_start_failures": sum(len(s.get("start_failures", [])) for s in scenarios.values()),
        "wall_s": round(wall, 1),
        "scenarios": scenarios,
    }


async def main_async(args) -> dict[str, Any]:
    started = time.monotonic()
    plan: list[tuple[str, str]] = []
    for rnd in range(0 if args.no_faults else args.rounds):
        # the KV worker (lm) is replaced by its own faults, so the codec's come last in a round: the
        # final page count then sees what requests doomed by the codec left on the LM's worker
        plan += [("stop", "lm"), ("kill", "lm"), ("kill", "codec")] if rnd % 2 == 0 else \
            [("kill", "lm"), ("kill", "codec"), ("stop", "codec")]
    servers: list[Server] = []
    scenarios: dict[str, dict] = {}

    def launch(label: str) -> Server:
        server = Server(label, ["--config", str(PLACEMENT)] if label == "disaggregated" else [])
        server.ready = asyncio.ensure_future(server.wait_ready(args.start_timeout))
        servers.append(server)
        return server

    async def stop(label: str, server: Server) -> None:
        t_stop = time.monotonic()
        code = await asyncio.to_thread(server.stop)  # SIGINT: the server's own clean shutdown
        scenarios[label]["server_stop_s"] = round(time.monotonic() - t_stop, 2)
        scenarios[label]["server_exit_code"] = code
        scenarios[label]["server_log"] = log_summary(server.output())
        if args.keep_logs:
            scenarios[label]["server_log"]["path"] = server.log.name

    stopping: list[asyncio.Future] = []
    try:
        colocated = launch("colocated")
        # --quick overlaps the slower start (three processes) with the colocated scenario
        split = launch("disaggregated") if args.quick else None
        for label in ("colocated", "disaggregated"):
            if label == "disaggregated" and split is None:
                split = launch("disaggregated")
            server = colocated if label == "colocated" else split
            start_failures: list[str] = []
            while True:
                try:
                    result = await asyncio.wait_for(
                        run_scenario(server, args, faults_plan=plan if label == "disaggregated" else []),
                        args.scenario_limit,
                    )
                except StartError as exc:
                    # a server that fails to start is reported; it gets one more try so the rest can be measured
                    start_failures.append(str(exc)[-1500:])
                    print(f"[{label}] server failed to start (attempt {len(start_failures)}): "
                          f"{str(exc).splitlines()[-1]}", flush=True)
                    if len(start_failures) < 2:
                        await asyncio.to_thread(server.stop)
                        server = launch(label)
                        continue
                    result = {"error": f"StartError: {exc}"[-1500:]}
                except Exception as exc:  # a scenario that cannot run is reported, not fatal
                    msg = f"{type(exc).__name__}: {exc}" if str(exc) else \
                        f"{type(exc).__name__} (limit {args.scenario_limit}s)"
                    print(f"[{label}] scenario failed: {msg}", flush=True)
                    result = {"error": msg[-1500:]}
                break
            result["start_failures"] = start_failures
            scenarios[label] = result
            # the colocated server shuts down while the disaggregated scenario runs (it only waits)
            stopping.append(asyncio.ensure_future(stop(label, server)))
        await asyncio.gather(*stopping)
    finally:
        for task in stopping:
            task.cancel()
        for server in servers:
            if server.ready is not None and not server.ready.done():
                server.ready.cancel()
            server.stop(grace=5.0)
            server.close(args.keep_logs)
    return summarize(scenarios, time.monotonic() - started, args.quick)


@atexit.register
def _stop_all() -> None:
    for server in _SERVERS:
        with contextlib.suppress(Exception):
            server.stop(grace=5.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, 4 client loops (< 60 s on 2 CPU cores)")
    parser.add_argument("--rounds", type=int, default=None, help="fault rounds (kill each worker, stop one); default 1 quick, 2 full")
    parser.add_argument("--concurrency", type=int, default=None, help="healthy client loops (default 4 quick, 6 full)")
    parser.add_argument("--max-requests", type=int, default=400, help="most requests one client loop sends")
    parser.add_argument("--timeout", type=float, default=None, help="client timeout per request (default 30 quick, 60 full)")
    parser.add_argument("--kill-limit", type=float, default=None, help="most seconds to wait for recovery after a kill")
    parser.add_argument("--stop-window", type=float, default=None,
                        help="seconds a stopped worker is left for supervision before SIGCONT (default 12 quick, 20 full)")
    parser.add_argument("--poison-gap", type=float, default=0.2, help="seconds between poisoned requests")
    parser.add_argument("--tail", type=float, default=None, help="seconds of plain traffic after the poisons / faults")
    parser.add_argument("--settle", type=float, default=0.5, help="seconds between faults after a recovery")
    parser.add_argument("--start-timeout", type=float, default=120.0, help="seconds for a server to become healthy")
    parser.add_argument("--scenario-limit", type=float, default=None, help="hard limit per scenario, seconds")
    parser.add_argument("--no-poisons", action="store_true", help="plain traffic only (calibrates the harness)")
    parser.add_argument("--no-faults", action="store_true", help="no kill/stop (calibrates the harness)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the servers' logs and print their paths")
    args = parser.parse_args()
    q = args.quick
    args.rounds = args.rounds or (1 if q else 2)
    args.concurrency = args.concurrency or (4 if q else 6)
    # only a hang ever waits this long; a busy 2-core box with three servers' processes is slow, not hung
    args.timeout = args.timeout or (30.0 if q else 60.0)
    args.kill_limit = args.kill_limit or (20.0 if q else 30.0)
    args.stop_window = args.stop_window or (12.0 if q else 20.0)
    args.tail = args.tail if args.tail is not None else (1.0 if q else 5.0)
    args.scenario_limit = args.scenario_limit or (240.0 if q else 900.0)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    def _terminate(signum, frame):  # SIGTERM: unwind through the finally blocks that stop the servers
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    try:
        result = asyncio.run(main_async(args))
    except KeyboardInterrupt:
        print("chaos: interrupted; servers and workers stopped", file=sys.stderr)
        sys.exit(130)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
