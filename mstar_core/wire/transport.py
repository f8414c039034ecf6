"""The small interface every transport plugin implements, and the bind-address policy they share.

A transport is a point-to-point, message-oriented, bidirectional channel of frames (a frame is any
bytes-like object; tensor transports also accept tensors). One side `bind`s, the other `connect`s;
the connecting side speaks first. `send_msg`/`recv_msg` wrap the wire codec. Received frames may
alias transport buffers (zero copy): decoded tensors are read-only views, clone them to keep them.
"""

from __future__ import annotations

import abc
import asyncio
import ipaddress
import socket
from collections.abc import Sequence
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


class Transport(abc.ABC):
    """Point-to-point frame channel; subclasses implement bind/connect/send/recv/close."""

    name: ClassVar[str] = "?"

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
