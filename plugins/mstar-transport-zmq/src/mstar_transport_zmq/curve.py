"""CURVE keypairs derived from the shared secret, and a ZAP authenticator that admits only them.

Both sides derive the same keys from the secret, so no key files need distributing: a peer that
does not know the secret cannot complete the CURVE handshake and the server never sees its messages.
"""

from __future__ import annotations

import hashlib
import hmac

import zmq
import zmq.auth.thread

from mstar_core.wire.errors import TransportError


def derive_keypair(secret: bytes, role: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 CURVE keys for `role` ('server' or 'client'), deterministic in the secret."""
    if not zmq.has("curve"):
        raise TransportError("this libzmq has no CURVE support; install pyzmq wheels (bundled libsodium)")
    raw = hmac.new(secret, f"mstar-curve-{role}".encode(), hashlib.sha256).digest()
    sk = zmq.utils.z85.encode(raw)
    return zmq.curve_public(sk), sk


class _OnlyKey:
    """ZAP credentials provider: accept exactly one client public key."""

    def __init__(self, public: bytes):
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(zmq.utils.z85.encode(key) if len(key) == 32 else key, self.public)


def make_server(ctx: zmq.Context, sock: zmq.Socket, secret: bytes) -> zmq.auth.thread.ThreadAuthenticator:
    """Turn `sock` into a CURVE server admitting only clients that hold `secret`; returns the authenticator."""
    auth = zmq.auth.thread.ThreadAuthenticator(ctx)
    auth.start()
    client_public, _ = derive_keypair(secret, "client")
    auth.configure_curve_callback(domain="*", credentials_provider=_OnlyKey(client_public))
    public, sk = derive_keypair(secret, "server")
    sock.curve_secretkey = sk
    sock.curve_publickey = public
    sock.curve_server = True
    return auth


def make_client(sock: zmq.Socket, secret: bytes) -> None:
    """Give `sock` the client keys derived from `secret` and the server key to expect."""
    public, sk = derive_keypair(secret, "client")
    sock.curve_secretkey = sk
    sock.curve_publickey = public
    sock.curve_serverkey, _ = derive_keypair(secret, "server")
