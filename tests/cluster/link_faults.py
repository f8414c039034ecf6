"""Network faults between the serving process and a worker in its own namespace (issue 31, item 9).

Tiny Orpheus with its LM here and its SNAC codec on a worker that joins from a namespace over a
veth pair (CURVE-encrypted control link, heartbeats every 0.2 s). `tc` impairs both ends of the
pair: with netem, a delay (40 ms each way), a 2 % loss and a partition (100 % loss); a kernel
without netem (this box's has neither sch_netem nor tc actions) gets the nearest it has: a slow
link (tbf at 1 Mbit/s; no added latency as such), bursty loss (the link drops everything for
100 ms of every second, about 10 % of packets, which TCP resends) and a partition that drops every
packet (pfifo with no room). `run()` measures:

* each impairment: one request end to end (its audio must equal the unimpaired reference);
* the partition: how long a request in flight takes to fail (WorkerLost, 503), how fast a request
  sent during the partition is refused, the serving loop's worst lag meanwhile (the control plane
  must not wedge), and after the heal `rejoin_s` (until the worker is ready again) and
  `partition_recovery_s`: from the heal to the end of the first request whose audio equals the
  reference (so it includes that request's own time: `reference.seconds` says how long one takes).
  TCP's retransmission back-off decides when the worker hears from the server again after the heal. The worker is the same process throughout: declared
  lost, it joins again by itself once the link is back (`Shutdown.rejoin`) and is reloaded.

Shared by tests/cluster/test_link_faults.py and benchmarks/chaos.py. Needs root, `ip` and `tc`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tests.cluster.netns import NamespacedWorkerHost, unavailable, worker_namespace

ROOT = Path(__file__).resolve().parents[2]
SECRET = "a secret for the link-fault test"
SHORT = {"text": "Hello from M star.", "voice": "tara", "seed": 7, "max_tokens": 120}
LONG = {"text": "Hello from M star, " * 8, "voice": "tara", "seed": 7, "max_tokens": 4000}
HEARTBEAT_S = 0.2


def why_not() -> str | None:
    """Why the link faults cannot run here, or None."""
    why = unavailable()
    if why:
        return why
    if shutil.which("tc") is None:
        return "the `tc` command (iproute2) is not installed"
    return None


def qdisc_works(*args: str) -> bool:
    """Whether this kernel has the qdisc `args` names (tried on the loopback of a scratch namespace)."""
    ns = f"mstar-qd-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", ns], capture_output=True).returncode != 0:
        return False
    try:
        made = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", *args], capture_output=True)
        return made.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def impairments() -> dict[str, tuple[list[str], str, tuple[float, float] | None]]:
    """name -> (the root qdisc put on both ends of the link, what it does, (outage s, period s) when it flaps)."""
    if qdisc_works("netem", "delay", "1ms"):
        return {"delay": (["netem", "delay", "40ms", "5ms"], "netem: 40 ms (+-5) each way", None),
                "loss": (["netem", "loss", "2%"], "netem: 2 % of packets lost each way", None),
                "partition": (["netem", "loss", "100%"], "netem: every packet lost", None)}
    return {"delay": (["tbf", "rate", "1mbit", "burst", "2kb", "latency", "500ms"],
                      "no netem here: a slow link, tbf at 1 Mbit/s (serialisation and queueing delay only)", None),
            "loss": (["pfifo", "limit", "0"], "no netem here: the link drops every packet for 100 ms of every "
                     "second (bursty loss, about 10 %; TCP resends)", (0.1, 1.0)),
            "partition": (["pfifo", "limit", "0"], "no netem here: pfifo with no room (every packet dropped)", None)}


class Flapping:
    """The link cut for `outage_s` of every `period_s` (bursty loss without netem); counts what it dropped."""

    def __init__(self, link: Link, qdisc: list[str], outage_s: float, period_s: float):
        self.link, self.qdisc, self.outage_s, self.period_s = link, qdisc, outage_s, period_s
        self.dropped = 0
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.to_thread(self.link.impair, self.qdisc)
            try:
                await asyncio.sleep(self.outage_s)
            finally:
                self.dropped += self.link.dropped()
                self.link.heal()
            await asyncio.sleep(self.period_s - self.outage_s)

    async def stop(self) -> int:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.link.heal()
        return self.dropped


class Link:
    """Both ends of the veth pair between this host and the worker's namespace."""

    def __init__(self, host: NamespacedWorkerHost):
        self.host = host

    def _ends(self) -> list[list[str]]:
        return [["tc", "qdisc", "{}", "dev", self.host.dev_here, "root"],
                ["tc", "-n", self.host.ns, "qdisc", "{}", "dev", self.host.dev_there, "root"]]

    def impair(self, qdisc: list[str]) -> None:
        for cmd in self._ends():
            subprocess.run([c.replace("{}", "replace") for c in cmd] + qdisc, check=True, capture_output=True)

    def heal(self) -> None:
        for cmd in self._ends():
            subprocess.run([c.replace("{}", "del") for c in cmd], capture_output=True)

    def dropped(self) -> int:
        """Packets the root qdiscs of both ends dropped so far (what an impairment did)."""
        total = 0
        for prefix, dev in ((["tc"], self.host.dev_here), (["tc", "-n", self.host.ns], self.host.dev_there)):
            shown = subprocess.run([*prefix, "-s", "qdisc", "show", "dev", dev, "root"], capture_output=True, text=True)
            total += sum(int(n) for n in re.findall(r"dropped (\d+)", shown.stdout))
        return total


def free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


async def audio(engine: Any, request: dict) -> list[torch.Tensor]:
    return [torch.as_tensor(o.value).clone() async for o in engine.submit("orpheus", dict(request))
            if o.name == "audio"]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class LagMeter:
    """The serving event loop's worst lag while it runs (a wedged control plane shows here)."""

    def __init__(self, tick: float = 0.05):
        self.tick, self.worst = tick, 0.0
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(self.tick)
            self.worst = max(self.worst, time.monotonic() - t - self.tick)

    def stop(self) -> float:
        self._task.cancel()
        return round(self.worst, 3)


async def _partition(engine: Any, link: Link, qdisc: list[str], reference: list, hold_s: float,
                     recover_limit_s: float) -> dict[str, Any]:
    from mstar_core.cluster.worker_link import WorkerLost

    codec = engine.cluster.workers["codec"]
    out: dict[str, Any] = {"pid_before": codec.pid, "restarts_before": codec.restarts}
    handle = engine.submit("orpheus", dict(LONG))
    async for o in handle:
        if o.name == "audio":
            break
    lag = LagMeter()
    link.impair(qdisc)
    cut = time.monotonic()
    try:
        await asyncio.wait_for(handle.result(), 30)
        out["in_flight"] = {"failed": False}
    except Exception as exc:
        out["in_flight"] = {"failed": True, "type": type(exc).__name__, "status": getattr(exc, "status", None),
                            "fail_s": round(time.monotonic() - cut, 3)}
    sent = time.monotonic()
    try:
        await asyncio.wait_for(audio(engine, SHORT), 30)
        out["during"] = {"refused": False}
    except WorkerLost as exc:
        out["during"] = {"refused": True, "status": exc.status, "refuse_s": round(time.monotonic() - sent, 3)}
    except Exception as exc:
        out["during"] = {"refused": False, "type": type(exc).__name__, "message": str(exc)[:200]}
    await asyncio.sleep(max(0.0, hold_s - (time.monotonic() - cut)))
    out["partition_s"] = round(time.monotonic() - cut, 3)
    out["dropped_packets"] = link.dropped()
    link.heal()
    healed = time.monotonic()
    out["loop_lag_max_s"] = lag.stop()
    rejoined = asyncio.ensure_future(_await_ready(codec, recover_limit_s))
    attempts = 0
    while time.monotonic() - healed < recover_limit_s:
        attempts += 1
        try:
            if same(await asyncio.wait_for(audio(engine, SHORT), 60), reference):
                out["partition_recovery_s"] = round(time.monotonic() - healed, 3)
                break
        except Exception as exc:
            out["last_error"] = f"{type(exc).__name__}: {exc}"[:200]
        await asyncio.sleep(0.25)
    else:
        out["partition_recovery_s"] = None
    ready_at = await rejoined
    out["rejoin_s"] = None if ready_at is None else round(ready_at - healed, 3)
    out.update(recovery_attempts=attempts, pid_after=codec.pid, restarts_after=codec.restarts, ready=codec.ready)
    return out


async def run(*, hold_s: float = 3.0, recover_limit_s: float = 90.0, phases: tuple[str, ...] = ("delay", "loss"),
              log_path: str | None = None) -> dict[str, Any]:
    """The scenario of this module's docstring; a dict of figures (`partition_recovery_s` among them)."""
    from mstar_core.cluster.strategy import placed_engine
    from mstar_core.config import Placement
    from mstar_core.model import LoadOptions
    from mstar_core.plugins import discover

    kinds = impairments()
    result: dict[str, Any] = {"impairments": {k: v[1] for k, v in kinds.items()}}
    saved = os.environ.get("MSTAR_SECRET")
    os.environ["MSTAR_SECRET"] = SECRET
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MSTAR_JOIN_TIMEOUT": "120",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    log = open(log_path or os.devnull, "w")
    try:
        with worker_namespace() as host, contextlib.closing(log):
            link = Link(host)
            bind = f"tcp://{host.addr_here}:{free_port(host.addr_here)}"
            worker = host.popen([sys.executable, "-m", "mstar_core.cluster.worker", "--join", bind, "--name", "codec"],
                                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            placement = Placement.from_dict({
                "workers": {"codec": {"host": host.addr_there, "device": "cpu"}},
                "nodes": {"snac": "codec"},
                "engine_settings": {"lm": {"num_pages": 512, "page_size": 16}},
                "control": {"bind": bind, "heartbeat_interval": HEARTBEAT_S},
            })
            engine = placed_engine(discover())
            try:
                await engine.load_model("orpheus", LoadOptions(preset="tiny"), placement=placement)
                codec = engine.cluster.workers["codec"]
                result.update(encrypted=engine.cluster.encrypted, worker_pid=worker.pid, joined_pid=codec.pid)
                t = time.monotonic()
                reference = await audio(engine, SHORT)
                result["reference"] = {"chunks": len(reference), "seconds": round(time.monotonic() - t, 3)}
                for name in phases:
                    restarts = codec.restarts
                    qdisc, _, flap = kinds[name]
                    flapping = Flapping(link, qdisc, *flap) if flap else None
                    if flapping is None:
                        link.impair(qdisc)
                    t = time.monotonic()
                    try:
                        got = await asyncio.wait_for(audio(engine, SHORT), 120)
                        result[name] = {"same_audio": same(got, reference), "seconds": round(time.monotonic() - t, 3)}
                    except Exception as exc:
                        result[name] = {"same_audio": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
                    finally:
                        if flapping is not None:
                            result[name]["dropped_packets"] = await flapping.stop()
                        else:
                            result[name]["dropped_packets"] = link.dropped()
                            link.heal()
                    result[name]["worker_lost"] = codec.restarts != restarts or not codec.ready
                    await _await_ready(codec, 60)
                result["partition"] = await _partition(engine, link, kinds["partition"][0], reference, hold_s,
                                                       recover_limit_s)
                result["worker_alive_after"] = worker.poll() is None
            finally:
                await engine.close()
    finally:
        if saved is None:
            os.environ.pop("MSTAR_SECRET", None)
        else:
            os.environ["MSTAR_SECRET"] = saved
    result["partition_recovery_s"] = result.get("partition", {}).get("partition_recovery_s")
    return result


async def _await_ready(codec: Any, timeout: float) -> float | None:
    """When the worker is ready (again), or None after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not codec.ready:
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.05)
    return time.monotonic()
