"""ZmqTransport: a point-to-point frame channel on ZeroMQ (ROUTER on the bound side, DEALER connecting).

The bound side talks to one peer: the first that sends to it (the connecting side speaks first).
Messages from any other peer are dropped until `unpin()` (e.g. after that peer died). With a shared
secret, both sides use CURVE keys derived from it, so peers without the secret are refused during
the handshake; binding beyond loopback needs `allow_remote=True` and a secret.
"""

from __future__ import annotations

import logging
import os
import tempfile
import uuid
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio

from mstar_core.wire.errors import TransportError
from mstar_core.wire.transport import InlineLink, Transport, TransportLink, check_bind_address
from mstar_transport_zmq import curve

log = logging.getLogger("mstar.transport.zmq")
#: Frames at least this large are sent without copying (pyzmq keeps a reference until sent).
ZERO_COPY_MIN = 64 * 1024


_IPC_DIRS: set[str] = set()  # private dirs made by ipc_address, removed when their socket closes


def ipc_address(tag: str = "mstar") -> str:
    """A fresh IPC endpoint in a private (0700) temporary directory (removed when the binder closes)."""
    d = tempfile.mkdtemp(prefix=f"{tag}-{os.getpid()}-")
    _IPC_DIRS.add(d)
    return f"ipc://{d}/sock"


class ZmqTransport(Transport):
    """ZeroMQ transport over `tcp://HOST:PORT` or `ipc://PATH` (use port 0 to pick a free port)."""

    name = "zmq"

    @classmethod
    def worker_link(cls, role: str) -> TransportLink:
        """A worker link whose frames all stay on the (ZeroMQ) control socket."""
        return InlineLink("zmq")

    def __init__(self, *, secret: bytes | None = None, allow_remote: bool = False, hwm: int = 1000):
        self.secret = secret
        self.allow_remote = allow_remote
        self.hwm = hwm
        self._ctx = zmq.Context(io_threads=1)
        self._sock: zmq.Socket | None = None
        self._async: zmq.asyncio.Socket | None = None
        self._auth = None
        self._router = False
        self._peer: bytes | None = None
        self._closed = False
        self._ipc_path: str | None = None

    def _socket(self, kind: int) -> zmq.Socket:
        if self._sock is not None:
            raise TransportError("transport already bound or connected; make a new one")
        s = self._ctx.socket(kind)
        s.linger = 0
        s.sndhwm = s.rcvhwm = self.hwm
        self._sock = s
        return s

    def bind(self, address: str) -> str:
        check_bind_address(address, allow_remote=self.allow_remote, secret=self.secret)
        s = self._socket(zmq.ROUTER)
        self._router = True
        s.router_mandatory = True  # a send to a vanished peer raises instead of vanishing silently
        if self.secret:
            self._auth = curve.make_server(self._ctx, s, self.secret)
        if address.startswith("tcp://") and address.endswith(":0"):
            port = s.bind_to_random_port(address[: -len(":0")])
            return f"{address[: -len(':0')]}:{port}"
        try:
            s.bind(address)
        except zmq.ZMQError as e:
            raise TransportError(f"cannot bind {address}: {e}") from None
        if address.startswith("ipc://"):
            self._ipc_path = address[len("ipc://"):]
        return s.getsockopt_string(zmq.LAST_ENDPOINT)

    def connect(self, address: str) -> None:
        s = self._socket(zmq.DEALER)
        s.routing_id = uuid.uuid4().bytes
        if self.secret:
            curve.make_client(s, self.secret)
        try:
            s.connect(address)
        except zmq.ZMQError as e:
            raise TransportError(f"cannot connect to {address}: {e}") from None

    def unpin(self) -> None:
        """Forget the current peer so the next peer that speaks becomes it."""
        self._peer = None

    def _out(self, frames: Sequence[Any]) -> list[Any]:
        if self._sock is None or self._closed:
            raise TransportError("transport is not bound/connected (or closed)")
        out = list(frames)
        if self._router:
            if self._peer is None:
                raise TransportError("no peer yet: the connecting side must send first")
            out.insert(0, self._peer)
        return out

    def _in(self, parts: list[zmq.Frame]) -> list[Any] | None:
        if self._router:
            ident = parts[0].bytes
            if self._peer is None:
                self._peer = ident
            elif ident != self._peer:
                log.warning("dropping a message from a second peer; call unpin() to switch peers")
                return None
            parts = parts[1:]
        return [p.buffer if len(p) >= ZERO_COPY_MIN else p.bytes for p in parts]

    def send(self, frames: Sequence[Any]) -> None:
        try:
            self._sock.send_multipart(self._out(frames), copy=False)
        except zmq.ZMQError as e:
            raise TransportError(f"zmq send failed (peer gone?): {e}") from None

    def recv(self, timeout: float | None = None) -> list[Any]:
        if self._sock is None or self._closed:
            raise TransportError("transport is not bound/connected (or closed)")
        while True:
            if timeout is not None and not self._sock.poll(int(timeout * 1000)):
                raise TimeoutError(f"no message within {timeout}s")
            got = self._in(self._sock.recv_multipart(copy=False))
            if got is not None:
                return got

    def _asock(self) -> zmq.asyncio.Socket:
        if self._async is None:
            if self._sock is None or self._closed:
                raise TransportError("transport is not bound/connected (or closed)")
            self._async = zmq.asyncio.Socket.shadow(self._sock.underlying)
        return self._async

    async def asend(self, frames: Sequence[Any]) -> None:
        try:
            await self._asock().send_multipart(self._out(frames), copy=False)
        except zmq.ZMQError as e:
            raise TransportError(f"zmq send failed (peer gone?): {e}") from None

    async def arecv(self, timeout: float | None = None) -> list[Any]:
        s = self._asock()
        while True:
            if timeout is not None and not await s.poll(int(timeout * 1000)):
                raise TimeoutError(f"no message within {timeout}s")
            got = self._in(await s.recv_multipart(copy=False))
            if got is not None:
                return got

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
        if self._ipc_path is not None:
            d = os.path.dirname(self._ipc_path)
            try:
                os.unlink(self._ipc_path)
                if d in _IPC_DIRS:
                    _IPC_DIRS.discard(d)
                    os.rmdir(d)
            except OSError:
                pass
