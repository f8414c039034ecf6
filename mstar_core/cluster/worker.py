"""A worker process: joins a coordinator, hosts engines for the nodes placed on it, runs their steps.

    MSTAR_SECRET=... python -m mstar_core.cluster.worker --join tcp://HOST:PORT --name NAME

`Worker` composes its parts: `CoordinatorLink` (coordinator_link.py: the control socket, sealed
for its session, and the data link the Welcome names), `HostedEngines` (hosted_engines.py: the
models loaded here, their schedulers on this process's one device thread, their gauges),
`WorkerRequests` (worker_requests.py: node calls, delegated loops, stream consumers, state moves)
and the `PeerMailbox` (peer_mailbox.py) through which request state and stream items go straight
to other workers. It beats every `heartbeat_interval` with the engines' gauges, and routes each
message from the coordinator to the part whose job it is.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time

import torch

from mstar_core.cluster.coordinator_link import CoordinatorLink
from mstar_core.cluster.hosted_engines import HostedEngines
from mstar_core.cluster.peer_mailbox import PeerMailbox
from mstar_core.cluster.peer_streams import StreamLines
from mstar_core.cluster.worker_requests import WorkerRequests
from mstar_core.openmp import allow_huge_pages
from mstar_core.runtime.host_memory import keep_freed_memory
from mstar_core.wire import (
    ErrorReport,
    Heartbeat,
    InvokeNode,
    LoadModel,
    ModelLoaded,
    Release,
    RunLoop,
    Shutdown,
    WireError,
)
from mstar_core.wire.auth import secret_from_env
from mstar_core.wire.curve import needs_encryption
from mstar_core.wire.messages import RunConsumer, StreamEnd

log = logging.getLogger("mstar.worker")


class Worker:
    """One worker process's parts, and its life: join, beat, serve what the coordinator sends, leave."""

    def __init__(self, name: str, join: str, secret: bytes, parent_pid: int | None = None,
                 encrypt: bool | None = None):
        self.name = name
        self.join = join
        self.secret = secret
        self.parent_pid = parent_pid
        #: CURVE on the control link: by default whenever `join` is not a loopback or IPC address
        self.control = CoordinatorLink(name, join, secret, needs_encryption(join) if encrypt is None else encrypt)
        keep_freed_memory()  # the device thread's forwards reuse their pages instead of faulting them in again
        self.engines = HostedEngines(name)
        self._stop = asyncio.Event()
        self._loading: set[asyncio.Task] = set()
        self.mailbox: PeerMailbox | None = None  # state moved here directly by other workers (per-walk KV moves)
        self.lines: StreamLines | None = None  # the streams this worker's runs send to other workers, per request
        self.requests: WorkerRequests | None = None  # made once joined (it needs the mailbox)
        self.rejoin = False  # set when the server declared this (hand-joined) worker lost: run again, join anew

    @property
    def rank_group(self) -> tuple | None:
        """(split, channel) once this worker joined a tensor-parallel group."""
        return self.engines.rank_group

    async def run(self) -> None:
        registry = await self.engines.registry()  # imports, before any beat is due
        await self.control.connect(registry)
        host = self._peer_host()
        # CURVE exactly when the mailbox is reachable from other hosts: senders decide by its address the same way
        self.mailbox = PeerMailbox(self.secret, host, needs_encryption(f"tcp://{host}:0"))
        self.lines = StreamLines(self.mailbox)
        self.requests = WorkerRequests(self.name, self.engines, self.control, self.mailbox, self.lines)
        beat = asyncio.ensure_future(self._heartbeat())
        try:
            while not self._stop.is_set():
                msg = await self.control.recv()
                if isinstance(msg, Shutdown):
                    # a worker joined by hand has nobody to start it again: declared lost, it joins again itself
                    self.rejoin = msg.rejoin and self.parent_pid is None
                    if msg.reason:
                        log.warning("worker %s: %s: %s", self.name, "rejoining" if self.rejoin else "leaving",
                                    msg.reason)
                    break
                try:
                    self._dispatch(msg)
                except Exception:  # one bad message fails what it carried, never the worker
                    log.exception("worker %s: could not handle a %s", self.name, type(msg).__name__)
        finally:
            beat.cancel()
            await self.engines.close_schedulers()
            self.control.close_socket()
            self.engines.stop_device_thread()
            self.control.close_link()
            if self.mailbox is not None:
                self.mailbox.close()

    def _peer_host(self) -> str:
        """Where other workers reach this one: loopback, unless it joined the server from another host."""
        if not needs_encryption(self.join):
            return "127.0.0.1"
        import socket

        host = self.join.partition("://")[2].rsplit(":", 1)[0].strip("[]")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # no packet: only picks the interface on the route to the server
            return s.getsockname()[0]

    def _dispatch(self, msg) -> None:
        requests = self.requests
        if isinstance(msg, InvokeNode):
            requests.invoke(msg)
        elif isinstance(msg, RunLoop):
            requests.run_loop(msg)
        elif isinstance(msg, RunConsumer):
            requests.start_consumer(msg)
        elif isinstance(msg, StreamEnd):
            requests.stream_end(msg)
        elif isinstance(msg, Release):
            requests.release(msg.request_id)
        elif isinstance(msg, LoadModel):
            task = asyncio.ensure_future(self._load(msg))
            self._loading.add(task)
            task.add_done_callback(self._loading.discard)
        else:
            self.control.refusals.refuse("unexpected", "worker %s: the coordinator sent a %s; dropped", self.name,
                                         type(msg).__name__)

    async def _heartbeat(self) -> None:
        seq = 0
        while True:
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                log.warning("worker %s: serving process %s is gone; exiting", self.name, self.parent_pid)
                os._exit(0)
            seq += 1
            load = self.engines.gauges()
            link = self.control.link
            if link is not None:
                load["link"] = {"transport": link.name, **link.stats.as_dict()}
            if self.mailbox is not None:
                # stream_lines: the sending sessions this worker's runs hold open (until their requests' release)
                load["peer"] = {**self.mailbox.stats(), "stream_lines": self.lines.open_count() if self.lines else 0}
            try:
                await self.control.send(Heartbeat(worker=self.name, seq=seq, time=time.time(), load=load))
            except WireError:  # a gauge that cannot travel: beat without gauges
                await self.control.send(Heartbeat(worker=self.name, seq=seq, time=time.time()))
            await asyncio.sleep(self.control.heartbeat_interval)

    async def _load(self, msg: LoadModel) -> None:
        try:
            await self.engines.load(msg)
            await self.control.send(ModelLoaded(worker=self.name, model=msg.model, nodes=list(msg.nodes)))
        except Exception as exc:
            log.exception("worker %s failed to load %s", self.name, msg.model)
            await self.control.send(ErrorReport(worker=self.name, message=f"loading {msg.model}: {exc}",
                                                error_type=type(exc).__name__))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="mstar worker", description="Join an M* server as a worker process.")
    parser.add_argument("--join", required=True, help="the server's control address, e.g. tcp://10.0.0.2:7100")
    parser.add_argument("--name", required=True, help="the worker name the placement file gives this worker")
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--encrypt", choices=("auto", "on", "off"), default="auto",
                        help="CURVE-encrypt the control link (auto: when --join is not loopback or IPC, as the "
                             "server does for its bind address)")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s worker[{args.name}] %(levelname)s %(message)s")
    try:
        secret = secret_from_env()
    except Exception as exc:
        print(f"mstar worker {args.name}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    torch.set_num_threads(max(1, int(os.environ.get("MSTAR_WORKER_THREADS", torch.get_num_threads()))))
    allow_huge_pages()  # (a worker started after the server loaded its models inherits them off)
    try:
        while True:  # a hand-joined worker declared lost (a network partition healed) joins again, fresh
            worker = Worker(args.name, args.join, secret, args.parent_pid,
                            encrypt={"auto": None, "on": True, "off": False}[args.encrypt])
            asyncio.run(worker.run())
            if not worker.rejoin:
                break
    except KeyboardInterrupt:
        pass
    except Exception as exc:
        print(f"mstar worker {args.name}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    if worker.rank_group is not None:  # a follower thread blocks in a collective: leave without waiting for it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
