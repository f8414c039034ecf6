"""The chaos benchmark's faults: poisoned requests, `kill -9` / `SIGSTOP` of a worker with probes until recovery."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from chaos_driver import Driver, Rec, alive, proc_state, rss_mb, wait_mid_stream

PROBE = {"input": "Are you back?", "seed": 7, "max_tokens": 35}


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



# ---------------------------------------------------------------------------------------------
# stresses an operator or attacker applies: a burst past the limits, SIGTERM under load, a slow reader

BURST, BURST_RUNNING, BURST_QUEUED = 200, 4, 4
BURST_JOB = ("A burst of requests, each long enough to hold its place.", 5, 280)


async def burst_admission(drv: Driver) -> dict[str, Any]:
    """200 streamed requests at once against --max-running 4 --max-queued 4: exactly 192 must be refused (503)."""
    t0 = time.monotonic()
    recs = await asyncio.gather(*(drv.speech("burst", "burst", BURST_JOB) for _ in range(BURST)))
    refused = [r for r in recs if r.status == 503]
    return {
        "burst": BURST, "limits": f"{BURST_RUNNING} + {BURST_QUEUED}",
        "refused_503": len(refused), "served_ok": sum(1 for r in recs if r.outcome == "ok"),
        "other_outcomes": {o: n for o, n in _tally(r.outcome for r in recs if r.status != 503).items() if o != "ok"},
        "refused_without_retry_after": sum(1 for r in refused if r.retry_after is None),
        "wall_s": round(time.monotonic() - t0, 2),
        "burst_503_exact": len(refused) == BURST - BURST_RUNNING - BURST_QUEUED,
    }


async def drain_under_load(drv: Driver, jobs: list[tuple], *, in_flight: int = 6, late: int = 3) -> dict[str, Any]:
    """SIGTERM while `in_flight` streams run: each must finish whole (else it is lost), `late` new requests get 503."""
    tasks = [drv.spawn(drv.speech("healthy", "drain", jobs[i % len(jobs)])) for i in range(in_flight)]
    streaming = await wait_mid_stream(drv, in_flight, 20.0)
    t_signal = time.monotonic()
    drv.server.proc.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.2)
    late_recs = []
    for _ in range(late):
        late_recs.append(await drv.speech("late", "late", jobs[0]))
        await asyncio.sleep(0.1)
    recs = await asyncio.gather(*tasks)
    exit_code = await asyncio.to_thread(drv.server.proc.wait, 60)
    return {
        "in_flight": in_flight, "streaming_at_signal": streaming,
        "drain_lost": sum(1 for r in recs if r.outcome != "ok"),
        "lost_outcomes": _tally(r.outcome for r in recs if r.outcome != "ok"),
        "late_503": sum(1 for r in late_recs if r.status == 503), "late": late,
        "late_outcomes": _tally(r.outcome for r in late_recs),
        "exit_after_signal_s": round(time.monotonic() - t_signal, 2), "exit_code": exit_code,
    }


async def slow_reader(drv: Driver, *, readers: int = 4, max_tokens: int = 2000, pace_s: float = 0.05,
                      chunk: int = 512, hold_s: float = 15.0) -> dict[str, Any]:
    """`readers` streamed llama completions (ignore_eos: every token is produced) read `chunk` bytes every `pace_s`
    for `hold_s`, far slower than the server writes them, then hang up: the serving process' RSS growth over
    the run (after one warm-up request) and that the server serves a fresh request afterwards."""
    pid = drv.server.proc.pid
    body = {"model": "llama", "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    await drv.client.post("/v1/completions", json={**body, "max_tokens": 64, "stream": False})  # warm-up
    base = rss_mb(pid) or 0.0
    peak = [base]

    async def one() -> int:
        got = 0
        deadline = None
        async with drv.client.stream("POST", "/v1/completions", json=body) as r:
            async for data in r.aiter_raw(chunk):
                got += len(data)
                deadline = deadline or time.monotonic() + hold_s  # held from the first byte on
                if time.monotonic() > deadline:
                    break  # hang up mid-stream: the request is cancelled and its pages freed
                await asyncio.sleep(pace_s)
        return got

    async def sample(stop: asyncio.Event) -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_mb(pid) or 0.0)
            await asyncio.sleep(0.1)

    stop = asyncio.Event()
    sampler = asyncio.ensure_future(sample(stop))
    t0 = time.monotonic()
    sizes = await asyncio.gather(*(one() for _ in range(readers)), return_exceptions=True)
    stop.set()
    await sampler
    after = await drv.client.post("/v1/completions", json={**body, "max_tokens": 8, "stream": False})
    return {
        "readers": readers, "pace": f"{chunk} B every {pace_s} s for {hold_s} s", "max_tokens": max_tokens,
        "bytes_read": [s if isinstance(s, int) else f"{type(s).__name__}" for s in sizes],
        "rss_before_mb": round(base, 1), "rss_peak_mb": round(peak[0], 1),
        "slow_client_rss_growth_mb": round(peak[0] - base, 1), "wall_s": round(time.monotonic() - t0, 2),
        "served_after": after.status_code,
    }


def _tally(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


async def partition_heal(quick: bool, log_path: str | None = None) -> dict[str, Any]:
    """The codec's worker in its own network namespace: tc impairments, a partition and its heal (tests/cluster/link_faults).

    Runs here (the engine in this process, the worker in the namespace); `partition_recovery_s` is from the heal to
    the end of the first request with the reference audio. Without root, `ip` or `tc`: {"skipped": why}.
    """
    import sys

    from chaos_driver import REPO

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # tests.cluster.link_faults: the scenario the network-fault test runs
    from tests.cluster import link_faults

    why = link_faults.why_not()
    if why:
        return {"skipped": why, "partition_recovery_s": None}
    phases = () if quick else ("delay", "loss")
    return await link_faults.run(hold_s=3.0, recover_limit_s=60.0 if quick else 90.0, phases=phases, log_path=log_path)
