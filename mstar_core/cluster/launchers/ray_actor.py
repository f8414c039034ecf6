"""The `ray` launcher: each worker replica is a Ray actor running the ordinary `Worker`.

The actor only runs the worker process: it joins the server's control socket over TCP with the
shared secret and speaks the wire codec from then on. Nothing but the worker's name, the control
address and the secret pass through Ray (as actor arguments); model inputs and outputs never
enter Ray's object store. The process handle polls the actor's long-running `run` call, so a dead
actor reads like an exited subprocess and supervision restarts it.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from mstar_core.config.placement import WorkerSpec
from mstar_core.errors import MStarError

#: How long placing an actor may take before startup fails (e.g. no node has the resources).
PLACE_TIMEOUT_S = 60.0


class WorkerActor:
    """The actor body (wrapped with `ray.remote` at launch): runs one `Worker` until it leaves."""

    def __init__(self, name: str, join: str, secret: str, num_cpus: float, encrypt: bool = False):
        self.name, self.join, self.secret, self.num_cpus, self.encrypt = name, join, secret, num_cpus, encrypt

    def pid(self) -> int:
        return os.getpid()

    def where(self) -> tuple[int, str]:
        """This actor's process id and the id of the Ray node it was placed on."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    def run(self) -> int:
        import torch

        from mstar_core.cluster.worker import Worker

        torch.set_num_threads(max(1, int(self.num_cpus)))
        asyncio.run(Worker(self.name, self.join, self.secret.encode(), encrypt=self.encrypt).run())
        return 0


def _ray():
    try:
        import ray
    except ImportError:
        raise MStarError("launcher: ray needs the `ray` extra: pip install 'mstar[ray]'") from None
    return ray


def connect(address: str | None) -> None:
    """Join a Ray cluster once per process: `address` (e.g. auto), else one on this machine or a new local one."""
    ray = _ray()
    if ray.is_initialized():
        return
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except ConnectionError as exc:
        raise MStarError(f"cannot reach the Ray cluster at control.ray_address={address!r}: {exc}") from None


class RayWorkerProcess:
    """A `Popen`-like handle on a worker actor: `poll` is None while its `run` call is going."""

    def __init__(self, actor: Any, run_ref: Any, pid: int, node_id: str = ""):
        self.actor, self._ref, self.pid = actor, run_ref, pid
        self.node_id = node_id  # the Ray node the actor runs on (logs, tests: which host got which worker)
        self.returncode: int | None = None
        self.error = ""

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        ray = _ray()
        ready, _ = ray.wait([self._ref], timeout=0)
        if not ready:
            return None
        try:
            self.returncode = ray.get(ready[0])
        except Exception as exc:  # the actor died (killed, OOM, its node lost) or the worker raised
            self.error = f"{type(exc).__name__}: {exc}"
            self.returncode = -9 if isinstance(exc, ray.exceptions.RayActorError) else 1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        _ray().wait([self._ref], timeout=timeout)
        return self.poll()

    def kill(self) -> None:
        _ray().kill(self.actor, no_restart=True)


def launch_ray_worker(name: str, join: str, secret: bytes, spec: WorkerSpec, encrypt: bool = False) -> RayWorkerProcess:
    """Place one worker actor with the resources its device needs; blocks until it runs (call off the loop)."""
    ray = _ray()
    connect(spec.ray_address)
    # run() blocks for the worker's lifetime; a second slot keeps where() answerable meanwhile
    cls = ray.remote(max_concurrency=2)(WorkerActor)
    # supervision restarts the worker (and reloads its models), so Ray must not restart the actor itself
    actor = cls.options(num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, max_restarts=0).remote(
        name, join, secret.decode(), spec.num_cpus, encrypt)
    try:
        pid, node_id = ray.get(actor.where.remote(), timeout=PLACE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.kill(actor, no_restart=True)
        raise MStarError(
            f"Ray could not place worker '{name}' within {PLACE_TIMEOUT_S:.0f}s: it needs num_cpus={spec.num_cpus}, "
            f"num_gpus={spec.num_gpus}; the cluster has {ray.available_resources()} free"
        ) from None
    return RayWorkerProcess(actor, actor.run.remote(), pid, node_id)
