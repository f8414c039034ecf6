"""CURVE keypairs derived from the shared secret, and a ZAP authenticator that admits only them.

The key derivation and socket set-up live in the core (`mstar_core.wire.curve`), which encrypts the
control socket with the same keys; this module adds the thread-based authenticator the synchronous
transport uses.
"""

from __future__ import annotations

import zmq
import zmq.auth.thread

from mstar_core.wire.curve import OnlyKey, client_keys, derive_keypair, server_keys

__all__ = ["derive_keypair", "make_client", "make_server"]


def make_server(ctx: zmq.Context, sock: zmq.Socket, secret: bytes) -> zmq.auth.thread.ThreadAuthenticator:
    """Turn `sock` into a CURVE server admitting only clients that hold `secret`; returns the authenticator."""
    auth = zmq.auth.thread.ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=OnlyKey(derive_keypair(secret, "client")[0]))
    server_keys(sock, secret)
    return auth


def make_client(sock: zmq.Socket, secret: bytes) -> None:
    """Give `sock` the client keys derived from `secret` and the server key to expect."""
    client_keys(sock, secret)
