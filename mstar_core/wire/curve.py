"""CURVE encryption for ZeroMQ sockets, with keypairs derived from the shared secret.

Both sides derive the same keys from the secret, so no key files need distributing: a peer that does
not know the secret cannot complete the CURVE handshake (the server's ZAP handler admits only the
derived client key), and everything after the handshake is encrypted and authenticated by libzmq.
The control socket uses it on every link that leaves this host (`needs_encryption`).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import zmq

from mstar_core.wire.errors import TransportError
from mstar_core.wire.transport import is_loopback_host


def needs_encryption(address: str) -> bool:
    """True for a TCP address that is not loopback-only (another host may be on the other end)."""
    scheme, sep, rest = address.partition("://")
    if scheme != "tcp" or not sep:
        return False
    return not is_loopback_host(rest.rsplit(":", 1)[0])


def derive_keypair(secret: bytes, role: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 CURVE keys for `role` ('server' or 'client'), deterministic in the secret."""
    if not zmq.has("curve"):
        raise TransportError("this libzmq has no CURVE support; install pyzmq wheels (bundled libsodium)")
    raw = hmac.new(bytes(secret), f"mstar-curve-{role}".encode(), hashlib.sha256).digest()
    sk = zmq.utils.z85.encode(raw)
    return zmq.curve_public(sk), sk


class OnlyKey:
    """ZAP credentials provider: accept exactly one client public key."""

    def __init__(self, public: bytes):
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(zmq.utils.z85.encode(key) if len(key) == 32 else key, self.public)


def server_keys(sock: zmq.Socket, secret: bytes) -> None:
    """Make `sock` a CURVE server with the key derived from `secret` (set before it binds)."""
    public, sk = derive_keypair(secret, "server")
    sock.curve_secretkey = sk
    sock.curve_publickey = public
    sock.curve_server = True


def client_keys(sock: zmq.Socket, secret: bytes) -> None:
    """Give `sock` the client keys derived from `secret` and the server key to expect (before it connects)."""
    public, sk = derive_keypair(secret, "client")
    sock.curve_secretkey = sk
    sock.curve_publickey = public
    sock.curve_serverkey, _ = derive_keypair(secret, "server")


def start_asyncio_authenticator(ctx: zmq.Context, secret: bytes) -> Any:
    """A ZAP handler on the running event loop admitting only clients holding `secret`; `.stop()` it at close."""
    from zmq.auth.asyncio import AsyncioAuthenticator

    auth = AsyncioAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=OnlyKey(derive_keypair(secret, "client")[0]))
    return auth
