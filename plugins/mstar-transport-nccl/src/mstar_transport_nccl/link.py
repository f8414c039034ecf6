"""The `nccl` worker link: a worker's big tensor frames over a private two-rank torch.distributed group.

Control stays on the sealed ZeroMQ socket. When a worker joins, the server's end opens a
rendezvous store (on loopback unless the placement allowed more: the store has no authentication)
and sends its port, a random key prefix and the backend in a sealed SETUP message; both ends then
form two groups over it, one per direction (NCCL serialises a pair's sends and receives on one
stream, so one group for both directions could deadlock when both ends send big frames at once).

A message with frames of at least `threshold` bytes travels as `[DATA, [null | [nbytes, on_device],
...], inline frames...]` on the socket; the big frames go, in the same order, over the group. The
sender's thread sends them (its event loop never waits); the receiver learns from the sealed
descriptor what to expect and queues it for its receive thread, which receives into fresh buffers
and resolves the message's future (the runtime delivers each link's messages in order). The
backend follows the worker's device (NCCL for CUDA, gloo otherwise) unless options force one: the
same code runs on gloo on a CPU-only machine. With NCCL, device tensors travel as device frames
(`keep_device`): GPU to GPU without a host copy.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import queue
import secrets
import threading
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
import torch

from mstar_core.wire.errors import TransportError, WireError
from mstar_core.wire.transport import TransportLink, is_loopback_host
from mstar_transport_nccl import group as pg

log = logging.getLogger("mstar.transport.nccl")

DATA = b"mstar-dist-data/1"
SETUP = b"mstar-dist-setup/1"
#: Frames smaller than this stay inline on the control socket (a group round trip costs more).
THRESHOLD = 16 * 1024
_STOP = object()


def _kind(frames: Sequence[Any]) -> bytes | None:
    if not frames:
        return None
    first = frames[0]
    if isinstance(first, torch.Tensor):
        return None
    view = memoryview(first)
    if view.nbytes in (len(DATA), len(SETUP)):
        tag = bytes(view)
        if tag in (DATA, SETUP):
            return tag
    return None


def _nbytes(frame: Any) -> int:
    return frame.numel() if isinstance(frame, torch.Tensor) else memoryview(frame).nbytes


def _as_flat(frame: Any) -> torch.Tensor:
    if isinstance(frame, torch.Tensor):
        return frame.reshape(-1).view(torch.uint8)
    with warnings.catch_warnings():  # read-only source buffers are only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(memoryview(frame), dtype=torch.uint8)


def _settle(future: concurrent.futures.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve a frames future unless it is already done (cancelled by the peer's loss)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


class DistLink(TransportLink):
    """One end (role 'server' = rank 0, 'worker' = rank 1) of a worker link over a torch.distributed group."""

    def __init__(self, role: str, *, backend: str | None = None, threshold: int = THRESHOLD,
                 allow_remote: bool = False, timeout_s: float = 120.0, device: str | None = None):
        super().__init__("nccl")
        if role not in ("server", "worker"):
            raise TransportError(f"role must be 'server' or 'worker', got {role!r}")
        if backend is not None and backend not in pg.BACKENDS:
            raise TransportError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
        self.role = role
        self.forced_backend = backend
        self.threshold = max(1, int(threshold))
        self.allow_remote = allow_remote
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = device  # this end's device for NCCL (default: the current CUDA device)
        self.backend: str | None = None  # once a peer joined
        self._session: _Session | None = None
        self._setup: list[Any] | None = None  # the SETUP message waiting to go to the worker
        self._peer_host = "127.0.0.1"  # the worker's: where the server's store listens
        self.sent_frames = self.received_frames = 0

    # -- set-up --------------------------------------------------------------------------------

    def peer_joined(self, info: Mapping[str, Any]) -> None:
        """Server: open the rendezvous for the new worker and queue its SETUP. Worker: remember where the server is."""
        self._end_session()
        host = pg.host_of(str(info.get("control", "")))
        if self.role == "worker":
            self._peer_host = host
            return
        if not is_loopback_host(host) and not self.allow_remote:
            raise TransportError(
                f"refusing an nccl/gloo link through control address {info.get('control')}: its rendezvous store and "
                f"the group's connections have no authentication or encryption, so another host could join or read "
                f"them; keep the control bind on loopback, or set `transport: {{name: nccl, allow_remote: true}}` "
                f"on a network you trust")
        backend = pg.pick_backend(info.get("device"), self.forced_backend)
        store, listener = pg.master_store(host, self.timeout)
        prefix = secrets.token_hex(16)
        hostname = "127.0.0.1" if is_loopback_host(host) else (None if host in ("0.0.0.0", "::", "*") else host)
        self._start(_Session(self, 0, backend, lambda: (store, listener), prefix, hostname))
        self._setup = [SETUP, orjson.dumps({"port": listener.getsockname()[1], "prefix": prefix, "backend": backend,
                                            "threshold": self.threshold, "timeout_s": self.timeout.total_seconds(),
                                            "device": str(info.get("device") or "cpu")})]

    def _start(self, session: _Session) -> None:
        self.backend = session.backend
        self.keep_device = session.backend == "nccl"
        self._session = session
        session.start()

    def _on_setup(self, head: Any) -> None:
        port, prefix, backend = int(head["port"]), str(head["prefix"]), str(head["backend"])
        backend = pg.pick_backend("cuda" if backend == "nccl" else "cpu", backend)
        self.threshold = max(1, int(head["threshold"]))
        self.timeout = datetime.timedelta(seconds=float(head["timeout_s"]))
        self.device = str(head["device"]) if backend == "nccl" else None  # the worker's own device
        host, timeout = self._peer_host, self.timeout
        hostname = pg.local_address_towards(host)
        self._end_session()
        self._start(_Session(self, 1, backend, lambda: (pg.client_store(host, port, timeout), None), prefix,
                             hostname))

    def control(self) -> list[Any] | None:
        setup, self._setup = self._setup, None
        return setup

    # -- data ----------------------------------------------------------------------------------

    def _pack(self, frames: Sequence[Any]) -> list[Any]:
        session = self._session
        big = [i for i, f in enumerate(frames) if i > 0 and _nbytes(f) >= self.threshold]
        if session is None or not big:
            return list(frames)
        desc: list[Any] = []
        inline, out = [], []
        for i, frame in enumerate(frames):
            if i == 0 or i not in big:
                desc.append(None)
                inline.append(frame)
                continue
            on_device = isinstance(frame, torch.Tensor) and frame.device.type != "cpu"
            desc.append([_nbytes(frame), int(on_device)])
            out.append(frame)
            self.stats.offloaded_bytes += _nbytes(frame)
        self.sent_frames += len(out)
        session.sends.put(out)
        return [DATA, orjson.dumps(desc), *inline]

    def _unpack(self, frames: Sequence[Any]) -> list[Any] | concurrent.futures.Future | None:
        tag = _kind(frames)
        if tag is None:
            return list(frames)
        try:
            head = orjson.loads(bytes(memoryview(frames[1])))
            if tag == SETUP:
                if self.role != "worker":
                    raise ValueError("only the server sets a link up")
                self._on_setup(head)
                return None
            if not isinstance(head, list):
                raise ValueError("descriptors must be a list")
            inline = list(frames[2:])
            expected = []
            for d in head:
                if d is None:
                    continue
                nbytes, on_device = int(d[0]), bool(d[1])
                if nbytes < 0:
                    raise ValueError("negative frame size")
                expected.append((nbytes, on_device))
            if len(head) - len(expected) != len(inline):
                raise ValueError("descriptor count does not match the inline frames")
        except (KeyError, TypeError, ValueError, IndexError, orjson.JSONDecodeError) as exc:
            raise WireError(f"malformed nccl link message: {type(exc).__name__}: {exc}") from None
        session = self._session
        if session is None:
            raise WireError("an nccl link message arrived before the link was set up")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.received_frames += len(expected)
        session.recvs.put((future, head, inline, expected))
        return future

    # -- ends ----------------------------------------------------------------------------------

    def _end_session(self, join: float = 0.0) -> None:
        session, self._session = self._session, None
        self._setup = None
        if session is not None:
            session.close(join)

    def peer_lost(self) -> None:
        """Drop the group: what was still in flight fails; the next peer gets a new group."""
        self._end_session()

    def close(self) -> None:
        self._end_session(join=1.0)


class _Session:
    """One peer's groups and the two threads that send and receive over them, in order."""

    def __init__(self, link: DistLink, rank: int, backend: str, make_store, prefix: str, hostname: str | None):
        self.link, self.rank, self.backend = link, rank, backend
        self._make_store, self._prefix, self._hostname = make_store, prefix, hostname
        self.sends: queue.SimpleQueue = queue.SimpleQueue()
        self.recvs: queue.SimpleQueue = queue.SimpleQueue()
        self.ready = threading.Event()
        self.dead: str | None = None
        self.out_group = self.in_group = None
        self._keep: list[Any] = []  # the store and its socket live as long as the groups
        self._device = torch.device("cpu")
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        name = f"mstar-{self.backend}-{self.link.role}"
        self._threads = [threading.Thread(target=self._run_sends, name=f"{name}-send", daemon=True),
                         threading.Thread(target=self._run_recvs, name=f"{name}-recv", daemon=True)]
        threading.Thread(target=self._form, name=f"{name}-setup", daemon=True).start()
        for t in self._threads:
            t.start()

    def _form(self) -> None:
        try:
            import torch.distributed as dist

            if self.backend == "nccl":
                self._device = torch.device(self.link.device or f"cuda:{torch.cuda.current_device()}")
                torch.cuda.set_device(self._device)
            store, listener = self._make_store()
            self._keep = [store, listener]
            timeout = self.link.timeout
            down = pg.two_rank_group(dist.PrefixStore(f"{self._prefix}/down/", store), self.rank, self.backend,
                                     timeout, self._hostname)
            up = pg.two_rank_group(dist.PrefixStore(f"{self._prefix}/up/", store), self.rank, self.backend,
                                   timeout, self._hostname)
            self.out_group, self.in_group = (down, up) if self.rank == 0 else (up, down)
        except Exception as exc:
            self.fail(f"forming the {self.backend} group failed: {exc}")
        finally:
            self.ready.set()

    def _wait_ready(self) -> bool:
        self.ready.wait()
        return self.dead is None

    def _run_sends(self) -> None:
        if self.backend == "nccl":
            self.ready.wait()
            if self.dead is None:
                torch.cuda.set_device(self._device)
        while True:
            frames = self.sends.get()
            if frames is _STOP or not self._wait_ready():
                return
            try:
                for frame in frames:
                    flat = _as_flat(frame)
                    if flat.numel():
                        self.out_group.send([flat.to(self._device)], 1 - self.rank, 0).wait()
            except Exception as exc:
                self.fail(f"sending over the {self.backend} group failed: {exc}")
                return

    def _run_recvs(self) -> None:
        if self.backend == "nccl":
            self.ready.wait()
            if self.dead is None:
                torch.cuda.set_device(self._device)
        while True:
            item = self.recvs.get()
            if item is _STOP:
                return
            future, head, inline, _ = item
            if not self._wait_ready():
                _settle(future, error=WireError(f"nccl link: {self.dead}"))
                continue
            try:
                out, rest = [], iter(inline)
                for d in head:
                    if d is None:
                        out.append(next(rest))
                        continue
                    buf = torch.empty(int(d[0]), dtype=torch.uint8, device=self._device)
                    if buf.numel():
                        self.in_group.recv([buf], 1 - self.rank, 0).wait()
                    out.append(buf if d[1] or buf.device.type == "cpu" else buf.cpu())
            except Exception as exc:
                _settle(future, error=WireError(f"receiving over the {self.backend} group failed: {exc}"))
                self.fail(f"receiving over the {self.backend} group failed: {exc}")
                return
            _settle(future, result=out)

    def fail(self, why: str) -> None:
        """The group broke: fail what waits, and tell the link's owner (unless this session was already ended)."""
        if self.dead is not None:
            return
        self.dead = why
        self._fail_pending(why)
        if self.link._session is self:
            log.error("nccl link (%s end): %s", self.link.role, why)
            self.link.failed(why)

    def _fail_pending(self, why: str) -> None:
        while True:
            try:
                item = self.recvs.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                _settle(item[0], error=WireError(f"nccl link: {why}"))

    def close(self, join: float) -> None:
        if self.dead is None:
            self.dead = "the link was closed (peer lost or replaced)"
        self._fail_pending(self.dead)
        self.sends.put(_STOP)
        self.recvs.put(_STOP)
        self.ready.set()  # a group still forming stops at its timeout; nothing waits for it
        for t in self._threads:
            if join:
                t.join(join)
        # Drop the groups and the store now (a thread still inside an operation keeps its own reference):
        # left to the interpreter's exit, torch's destructors can abort the process.
        self.out_group = self.in_group = self._make_store = None
        self._keep = []
