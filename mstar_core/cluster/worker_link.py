"""What the serving process knows about one worker: its process, its session, the calls it owes answers to.

A `WorkerLink` holds no socket: `WorkerSender` (sender.py) sends for it and the receive loop
(receiver.py, dispatch.py) hands it what its worker sent. It resolves the futures
of the calls and delegated loops in flight on that worker, and when the worker is lost it fails
all of them at once and remembers which requests held state there, so none of them waits for an
answer that can no longer come.
"""

from __future__ import annotations

import asyncio
from typing import Any

from mstar_core.cluster.remote_values import from_wire
from mstar_core.config.placement import WorkerSpec
from mstar_core.errors import MStarError, NodeExecutionError, RequestError
from mstar_core.wire import ErrorReport, LoadModel, LoopDone, LoopValues, ModelLoaded, NodeResult, encode
from mstar_core.wire.messages import TAGS
from mstar_core.wire.session import Channel
from mstar_core.wire.transport import TransportLink, frames_bytes


class WorkerLost(RequestError):
    """The worker running part of this request died or hung; the request may be retried."""

    status = 503
    error_type = "worker_unavailable"  # not overload: a worker died, hung or is restarting


class RemoteError(Exception):
    """An exception raised inside a worker process, carried back by name and message."""


class RemoteRequestError(RequestError):
    """A request error raised inside a worker (an engine's rejection): keeps its status at the edge."""


def remote_failure(node: str, request_id: str, error: str, error_type: str | None, status: int | None,
                   param: str | None = None) -> Exception:
    """The exception a worker's error report becomes here: a 4xx stays a 4xx naming its field, anything else a 500."""
    if type(status) is int and 400 <= status <= 599:
        cause: Exception = RemoteRequestError(error, status=status, param=param)
    else:
        cause = RemoteError(f"{error_type or 'Error'}: {error}")
    return NodeExecutionError(node, request_id, cause)


class WorkerLink:
    """One worker process as seen from the serving process (attribute names are read by tests and metrics)."""

    def __init__(self, name: str, spec: WorkerSpec):
        self.name = name
        self.spec = spec
        self.process: Any = None  # a subprocess.Popen, or a launcher's handle with the same interface
        self.log_path: str | None = None
        self.pid: int | None = None  # as its Hello said (a hand-joined worker's process is not ours to poll)
        self.host = ""
        self.identity: bytes | None = None  # the ZeroMQ routing id its last authenticated message came from
        self.channel: Channel | None = None  # the authenticated session; None while not joined
        self.link: TransportLink | None = None  # the data path of its `transport`, made when it first joins
        self.inbox: Any = None  # its messages in order (links.OrderedInbox), frames still arriving included
        self.link_error: str | None = None  # why its link could not be set up when it last joined
        self.last_seen = 0.0
        self.joined = asyncio.Event()
        self.loads: dict[str, LoadModel] = {}  # model -> what to replay after a restart
        self.loaded: dict[str, asyncio.Future] = {}
        self.inflight: dict[tuple[str, str, int], asyncio.Future] = {}
        # delegated loops: (request id, loop index) -> (future of the env delta, values callback)
        self.loops: dict[tuple[str, int], tuple[asyncio.Future, Any]] = {}
        self.load: dict[str, Any] = {}  # the engines' gauges from the last heartbeat, by 'model/node'
        self.touched: set[str] = set()  # requests that may hold state here (not yet released)
        self.lost_requests: set[str] = set()  # requests whose state died with an earlier process
        self.restarts = 0
        self.alive = False  # connected and answering heartbeats
        self.ready = False  # has loaded its models and accepts invocations
        self.ready_since = 0.0
        self.restarting = False
        self.restart_task: asyncio.Task | None = None
        #: node calls' round trip through this link as the server sees it (send to answer, compute included), EWMA
        self.round_trip_s: float | None = None
        #: messages through the serving process to and from this worker: direction -> wire tag -> [count, bytes]
        self.traffic: dict[str, dict[str, list[int]]] = {"sent": {}, "received": {}}
        #: sealed socket messages from the worker (one carries all it sent in one turn of its event loop)
        self.socket_messages_received = 0

    def encode(self, msg: Any) -> list[Any]:
        """Frames of `msg` for this worker (device tensors stay on the device when its link moves them itself)."""
        frames = encode(msg, keep_device=self.link is not None and self.link.keep_device)
        self.count("sent", msg, frames)
        return frames

    def count(self, direction: str, msg: Any, frames: list[Any]) -> None:
        """Account one message through the serving process (its frames' bytes, before any transport moved them)."""
        entry = self.traffic[direction].setdefault(TAGS.get(type(msg), "?"), [0, 0])
        entry[0] += 1
        entry[1] += frames_bytes(frames)

    def observe_round_trip(self, seconds: float) -> None:
        self.round_trip_s = seconds if self.round_trip_s is None else 0.9 * self.round_trip_s + 0.1 * seconds

    def link_stats(self) -> dict[str, Any]:
        """Which transport carries this worker's tensors, what each end moved, and its peer line (from its heartbeats)."""
        return {
            "transport": self.link.name if self.link is not None else self.spec.transport,
            "server": self.link.stats.as_dict() if self.link is not None else {},
            "worker": {k: v for k, v in (self.load.get("link") or {}).items() if k != "transport"},
            "round_trip_s": self.round_trip_s,
            # what its peer line moved straight to and from other workers (its heartbeat's mailbox counters)
            "peer": {k: v for k, v in (self.load.get("peer") or {}).items() if k != "address"},
            "messages": {d: {tag: {"count": c, "bytes": b} for tag, (c, b) in by_tag.items()}
                         for d, by_tag in self.traffic.items()},
            "socket_messages_received": self.socket_messages_received,
        }

    # -- answers -------------------------------------------------------------------------------

    def on_result(self, msg: NodeResult) -> None:
        future = self.inflight.pop((msg.request_id, msg.node, msg.call_index), None)
        if future is None or future.done():
            return
        if msg.error is not None:
            node = msg.node.split("/", 1)[-1]
            future.set_exception(remote_failure(node, msg.request_id, msg.error, msg.error_type, msg.error_status,
                                                msg.error_param))
        else:
            try:
                future.set_result(from_wire(msg.outputs))
            except Exception as exc:  # a structured value we cannot rebuild: that call fails, nothing else
                future.set_exception(RequestError(f"worker '{self.name}' answered {msg.node}: {exc}", status=500))

    def on_loop_message(self, msg: LoopValues | LoopDone) -> None:
        entry = self.loops.get((msg.request_id, msg.loop, msg.branch))
        if entry is None or entry[0].done():
            return
        future, on_values = entry
        try:
            if isinstance(msg, LoopValues):
                on_values(msg.call, from_wire(msg.outputs))
            elif msg.error is not None:
                future.set_exception(remote_failure(msg.node or "?", msg.request_id, msg.error, msg.error_type,
                                                    msg.error_status, msg.error_param))
            else:
                future.set_result((from_wire(msg.env), msg.streamed))
        except Exception as exc:  # e.g. a stream's `keep` raised: fail this request, not the socket
            if not future.done():
                future.set_exception(exc)

    def on_loaded(self, msg: ModelLoaded) -> None:
        future = self.loaded.get(msg.model)
        if future is not None and not future.done():
            future.set_result(msg)

    def on_error_report(self, msg: ErrorReport) -> None:
        for future in self.loaded.values():
            if not future.done():
                future.set_exception(MStarError(f"worker '{self.name}': {msg.message}"))

    # -- requests ------------------------------------------------------------------------------

    def check_request(self, request_id: str) -> None:
        """Raise WorkerLost unless this worker can take a call for `request_id` now."""
        if not self.ready:
            raise WorkerLost(f"worker '{self.name}' is down (restarting); retry the request")
        if request_id in self.lost_requests:
            raise WorkerLost(f"worker '{self.name}' was restarted and lost this request's state; retry the request")
        self.touched.add(request_id)

    def forget(self, request_id: str) -> None:
        """The request ended: cancel whatever of it still waits on this worker."""
        self.touched.discard(request_id)
        self.lost_requests.discard(request_id)
        for key in [k for k in self.inflight if k[0] == request_id]:
            future = self.inflight.pop(key)
            if not future.done():
                future.cancel()
        for key in [k for k in self.loops if k[0] == request_id]:
            future = self.loops.pop(key)[0]
            if not future.done():
                future.cancel()

    def lost(self, why: str) -> set[str]:
        """The process is gone (or will be): fail everything in flight; returns the requests that held state here."""
        self.alive = self.ready = False
        self.joined.clear()
        self.identity = None
        self.channel = None
        self.load = {}
        if self.link is not None:
            self.link.peer_lost()
        if self.inbox is not None:
            self.inbox.clear()
        requests = self.touched | {k[0] for k in self.inflight} | {k[0] for k in self.loops}
        self.lost_requests |= requests
        self.touched = set()
        inflight, self.inflight = self.inflight, {}
        loops, self.loops = self.loops, {}
        for future in [*inflight.values(), *(f for f, _ in loops.values())]:
            if not future.done():
                future.set_exception(WorkerLost(f"worker '{self.name}' {why}; the request was lost, retry it"))
        for future in self.loaded.values():
            if not future.done():
                future.set_exception(WorkerLost(f"worker '{self.name}' {why} while loading its models"))
        return requests
