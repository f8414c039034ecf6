"""The serving process's control socket: one ZeroMQ ROUTER every worker joins, bound and (where it must be) encrypted.

By default it binds an IPC socket in a private directory, or loopback TCP. Any other address
(`control.bind` in placement, for workers on other hosts) needs the shared secret from MSTAR_SECRET
and is encrypted with CURVE keys derived from it (`mstar_core.wire.curve`): a peer without the
secret cannot even complete the handshake, and nothing on the wire is readable.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from typing import Any

import zmq
import zmq.asyncio

from mstar_core.errors import MStarError
from mstar_core.wire.auth import SECRET_ENV
from mstar_core.wire.curve import needs_encryption, server_keys, start_asyncio_authenticator
from mstar_core.wire.transport import check_bind_address


class ControlSocket:
    """The bound socket, its address, its secret and whether it is encrypted; nothing about the workers on it."""

    def __init__(self, bind: str | None = None, secret: bytes | None = None, encrypt: bool | None = None):
        self._bind = bind
        self._shared_secret = secret is not None  # given by the operator (MSTAR_SECRET), not made up here
        self.secret = secret if secret is not None else secrets.token_hex(24).encode()
        self._encrypt = encrypt  # None: encrypt exactly when the bind address reaches beyond this host
        self.encrypted = False
        self.address = ""
        self._auth: Any = None  # the ZAP handler of an encrypted (non-loopback) control socket
        self._tmpdir: str | None = None
        self._tcp: str | None = None
        self.ctx: Any = None
        self.sock: Any = None

    def open(self) -> None:
        """Bind (refusing an address that reaches other hosts without a shared secret and encryption)."""
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # a peer claiming a routing id already in use is ignored, never handed the worker's connection
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
        bind = self._bind
        if bind is None:
            self._tmpdir = tempfile.mkdtemp(prefix="mstar-ctl-")
            bind = f"ipc://{self._tmpdir}/control"
        remote = needs_encryption(bind)
        if remote and self._encrypt is False:
            raise MStarError(f"control.bind {bind} reaches other hosts, where the control link is always encrypted; "
                             "drop control.encrypt: false")
        if remote and not self._shared_secret:
            raise MStarError(f"control.bind {bind} accepts workers from other hosts: set {SECRET_ENV} to a shared "
                             "secret (the same on every host) to start")
        check_bind_address(bind, allow_remote=remote, secret=self.secret)
        if remote or self._encrypt:
            self._auth = start_asyncio_authenticator(self.ctx, self.secret)
            server_keys(self.sock, self.secret)
            self.encrypted = True
        try:
            self.sock.bind(bind)
        except zmq.ZMQError as exc:
            raise MStarError(f"cannot bind the control socket to {bind}: {exc}") from None
        self.address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    def tcp_address(self) -> str:
        """A TCP endpoint of the control socket (Ray actors need one): the bind address, or an added loopback one."""
        if self.address.startswith("tcp://"):
            return self.address
        if self._tcp is None:
            self.sock.bind("tcp://127.0.0.1:0")
            self._tcp = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        return self._tcp

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
        if self.sock is not None:
            self.sock.close(0)
        if self.ctx is not None:
            self.ctx.term()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
