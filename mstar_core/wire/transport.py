"""The small interfaces every transport plugin implements, and the bind-address policy they share.

A transport is a point-to-point, message-oriented, bidirectional channel of frames (a frame is any
bytes-like object; tensor transports also accept tensors). One side `bind`s, the other `connect`s;
the connecting side speaks first. `send_msg`/`recv_msg` wrap the wire codec. Received frames may
alias transport buffers (zero copy): decoded tensors are read-only views, clone them to keep them.

Between the serving process and a worker, control always travels on the ZeroMQ control socket
(sealed per session); the transport a placement names carries the big frames of those messages.
`Transport.worker_link(role, **options)` makes one end of that data path, a `TransportLink`: the
sender `pack`s a message's frames before sealing (taking big ones off the socket, leaving
descriptors), the receiver `unpack`s them after opening. `InlineLink` leaves every frame on the
socket. A link whose frames arrive after their descriptor (a process group's receive, on a thread of
its own) returns a `concurrent.futures.Future` from `unpack`; the receiving end delivers each link's
messages in order, waiting for such a future without blocking its event loop (`cluster/links.py`).
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import ipaddress
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from mstar_core.wire.codec import decode, encode
from mstar_core.wire.errors import TransportError


def is_loopback_host(host: str) -> bool:
    """True when `host` names only this machine (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind_address(address: str, *, allow_remote: bool, secret: bytes | None) -> None:
    """Refuse binds that would expose a socket beyond this host unless explicitly allowed with a secret."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        raise TransportError(f"address '{address}' needs a scheme, e.g. tcp://127.0.0.1:5555 or ipc:///tmp/x")
    if scheme in ("ipc", "inproc"):
        return
    if scheme != "tcp":
        raise TransportError(f"address '{address}': unsupported scheme '{scheme}' (use tcp or ipc)")
    host = rest.rsplit(":", 1)[0]
    if is_loopback_host(host):
        return
    if not allow_remote:
        raise TransportError(
            f"refusing to bind {address}: not a loopback address; pass allow_remote=True (and a shared "
            f"secret) to accept peers from other hosts"
        )
    if not secret:
        raise TransportError(f"binding {address} to other hosts requires a shared secret (set MSTAR_SECRET)")


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (tests and launchers)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LinkStats:
    """What one end of a worker link moved: messages and bytes each way, and how much went off the socket."""

    __slots__ = ("offloaded_bytes", "pack_seconds", "received_bytes", "received_messages", "sent_bytes",
                 "sent_messages", "unpack_seconds")

    def __init__(self) -> None:
        self.sent_messages = self.received_messages = 0
        self.sent_bytes = self.received_bytes = 0
        self.offloaded_bytes = 0  # bytes the transport carried itself (not on the control socket)
        self.pack_seconds = self.unpack_seconds = 0.0

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.__slots__}


def frames_bytes(frames: Sequence[Any]) -> int:
    """Total payload of a message's frames (bytes-like or tensors)."""
    total = 0
    for frame in frames:
        nbytes = getattr(frame, "nbytes", None)
        total += nbytes if isinstance(nbytes, int) else memoryview(frame).nbytes
    return total


class TransportLink(abc.ABC):
    """One end of a worker link's data path (see the module docstring); subclasses implement `_pack`/`_unpack`.

    What one end packs, the other end unpacks, in order. `unpack` returns None for a message meant
    for the link itself (e.g. the peer released shared-memory slots); `control()` is such a message
    to send the peer now. A message that is not packed (a plain wire message) passes `unpack` as is.
    `_unpack` may also return a `concurrent.futures.Future` of the frames (they are still arriving).
    """

    #: encode device tensors as device frames for this link (a tensor transport moves them itself)
    keep_device = False

    def __init__(self, name: str):
        self.name = name
        self.stats = LinkStats()
        #: called (from any thread) with why, when the link broke for good: its peer must be replaced
        self.on_failure: Callable[[str], None] | None = None

    def pack(self, frames: Sequence[Any]) -> list[Any]:
        """The frames to put on the control socket for this message."""
        start = time.perf_counter()
        out = self._pack(frames)
        self.stats.pack_seconds += time.perf_counter() - start
        self.stats.sent_messages += 1
        self.stats.sent_bytes += frames_bytes(frames)
        return out

    def unpack(self, frames: Sequence[Any]) -> list[Any] | concurrent.futures.Future | None:
        """The message's original frames (or a future of them), or None when it was for the link itself."""
        start = time.perf_counter()
        out = self._unpack(frames)
        self.stats.unpack_seconds += time.perf_counter() - start
        if isinstance(out, concurrent.futures.Future):
            out.add_done_callback(self._count_received)
        elif out is not None:
            self.stats.received_messages += 1
            self.stats.received_bytes += frames_bytes(out)
        return out

    def _count_received(self, future: concurrent.futures.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.stats.received_messages += 1
            self.stats.received_bytes += frames_bytes(future.result())

    @abc.abstractmethod
    def _pack(self, frames: Sequence[Any]) -> list[Any]: ...

    @abc.abstractmethod
    def _unpack(self, frames: Sequence[Any]) -> list[Any] | None: ...

    def control(self) -> list[Any] | None:
        """A message for the peer's link (sent sealed on the control socket), if one is pending."""
        return None

    def peer_joined(self, info: Mapping[str, Any]) -> None:
        """A (new) peer joined: set up what the link shares with it.

        `info["control"]` is the control address (the server's bind, or the address the worker
        joined); the server's end also gets `info["device"]`, the worker's device.
        """
        return None

    def failed(self, why: str) -> None:
        """Report that the link broke for good (any thread); the owner replaces the peer."""
        if self.on_failure is not None:
            self.on_failure(why)

    def peer_lost(self) -> None:
        """The peer died or was replaced: drop whatever was shared with it."""
        return None

    def close(self) -> None:
        """Release what this end owns; idempotent."""
        return None


class InlineLink(TransportLink):
    """Every frame stays on the control socket (the `zmq` transport's worker link)."""

    def _pack(self, frames: Sequence[Any]) -> list[Any]:
        return list(frames)

    def _unpack(self, frames: Sequence[Any]) -> list[Any]:
        return list(frames)


class Transport(abc.ABC):
    """Point-to-point frame channel; subclasses implement bind/connect/send/recv/close."""

    name: ClassVar[str] = "?"
    #: True when both ends must be on one host (shared memory): workers joining from elsewhere cannot use it.
    same_host: ClassVar[bool] = False
    #: the options a placement may give this transport's worker links (`transport: {name: ..., option: ...}`)
    link_options: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def worker_link(cls, role: str, **options: Any) -> TransportLink:
        """One end (`role` 'server' or 'worker') of a worker link whose big frames this transport carries."""
        raise TransportError(f"transport '{cls.name}' cannot carry the tensors of a worker link")

    @classmethod
    def check_link_options(cls, options: Mapping[str, Any], *, remote: bool) -> None:
        """Refuse options (or a set-up: `remote` = the control bind reaches other hosts) this transport cannot take."""
        unknown = sorted(set(options) - cls.link_options)
        if unknown:
            allowed = ", ".join(sorted(cls.link_options)) or "none"
            raise TransportError(f"transport '{cls.name}' takes no option {', '.join(map(repr, unknown))}; "
                                 f"its options: {allowed}")

    @abc.abstractmethod
    def bind(self, address: str) -> str:
        """Listen on `address`; returns the address peers should connect to."""

    @abc.abstractmethod
    def connect(self, address: str) -> None:
        """Connect to a bound peer."""

    @abc.abstractmethod
    def send(self, frames: Sequence[Any]) -> None:
        """Send one message made of frames; the buffers must stay unchanged until it is received."""

    @abc.abstractmethod
    def recv(self, timeout: float | None = None) -> list[Any]:
        """Receive one message's frames; raises TimeoutError after `timeout` seconds (None waits)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release sockets and memory; idempotent."""

    async def asend(self, frames: Sequence[Any]) -> None:
        """Async send (default: in a worker thread)."""
        await asyncio.to_thread(self.send, frames)

    async def arecv(self, timeout: float | None = None) -> list[Any]:
        """Async receive (default: in a worker thread)."""
        return await asyncio.to_thread(self.recv, timeout)

    def send_msg(self, msg: Any) -> None:
        """Encode a wire message and send it."""
        self.send(encode(msg))

    def recv_msg(self, timeout: float | None = None) -> Any:
        """Receive and decode one wire message."""
        return decode(self.recv(timeout))

    async def asend_msg(self, msg: Any) -> None:
        """Async `send_msg`."""
        await self.asend(encode(msg))

    async def arecv_msg(self, timeout: float | None = None) -> Any:
        """Async `recv_msg`."""
        return decode(await self.arecv(timeout))

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
