"""Shared-secret authentication for joining workers: HMAC-signed Hello and Welcome messages.

The worker signs its Hello (worker name, pid, host, protocol, a fresh nonce, a timestamp); the
coordinator checks the MAC, the clock skew and that the nonce was not seen before (replay), then
answers with a Welcome whose MAC binds the same nonce, so the worker knows the coordinator holds the
secret as well. Every message after that is sealed with keys derived from both nonces
(`mstar_core.wire.session`). Use it on any transport; the zmq transport can add CURVE encryption on top.

Verification never raises anything but AuthError, whatever the fields hold: a peer's bytes must
not be able to stop the side that checks them.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import secrets
import socket
import time
from collections import OrderedDict

from mstar_core.wire.errors import AuthError
from mstar_core.wire.messages import Hello, Welcome

#: 2: messages after the handshake are sealed (`mstar_core.wire.session`); errors carry their status.
#: 3: calls and delegated loops carry their request's arrival; errors carry the field they name (`param`).
#: 4: calls, delegated loops and consumers carry their priority (a Batch API line's background class).
PROTOCOL = 4
#: Environment variable the CLI reads the shared secret from (never pass it on a command line).
SECRET_ENV = "MSTAR_SECRET"


def secret_from_env(env: str = SECRET_ENV) -> bytes:
    """The shared secret from the environment; raises AuthError naming the variable when unset."""
    raw = os.environ.get(env, "")
    if len(raw) < 16:
        raise AuthError(f"set {env} to a shared secret of at least 16 characters on every host")
    return raw.encode()


def _mac(secret: bytes, *parts: object) -> str:
    if not isinstance(secret, (bytes, bytearray)) or not secret:
        raise AuthError("the shared secret must be non-empty bytes")
    data = "\x1f".join(str(p) for p in parts).encode("utf-8", "surrogatepass")
    return hmac.new(bytes(secret), data, hashlib.sha256).hexdigest()


def _hello_mac(secret: bytes, h: Hello) -> str:
    return _mac(secret, "hello", h.worker, h.pid, h.host, h.protocol, h.nonce, repr(h.timestamp))


def _same_mac(got: object, want: str) -> bool:
    """Constant-time MAC comparison that refuses (never raises on) non-str or non-ASCII input."""
    return isinstance(got, str) and got.isascii() and hmac.compare_digest(got, want)


def make_hello(secret: bytes, worker: str) -> Hello:
    """A signed Hello for `worker` from this process."""
    h = Hello(worker=worker, pid=os.getpid(), host=socket.gethostname(), protocol=PROTOCOL,
              nonce=secrets.token_hex(16), timestamp=time.time(), mac="")
    return Hello(**{**_fields(h), "mac": _hello_mac(secret, h)})


def _fields(m: object) -> dict:
    return {s.name: getattr(m, s.name) for s in type(m).__wire_fields__}


class HelloVerifier:
    """Coordinator side: checks Hello MACs, clock skew and nonce reuse; signs Welcomes."""

    def __init__(self, secret: bytes, max_skew_s: float = 60.0, remember: int = 4096):
        self.secret = secret
        self.max_skew_s = max_skew_s
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._remember = remember

    def verify(self, h: Hello) -> None:
        """Raise AuthError unless `h` is a fresh Hello signed with the shared secret."""
        if not isinstance(h, Hello):
            raise AuthError(f"expected a Hello first, got {type(h).__name__}")
        if h.protocol != PROTOCOL:
            raise AuthError(f"worker {h.worker!r} speaks protocol {h.protocol}, this side speaks {PROTOCOL}; "
                            "run the same M* version on every host")
        if not _same_mac(h.mac, _hello_mac(self.secret, h)):
            raise AuthError(f"worker {h.worker!r} from {h.host!r} failed authentication: wrong shared secret")
        if not math.isfinite(h.timestamp) or abs(time.time() - h.timestamp) > self.max_skew_s:
            raise AuthError(f"worker '{h.worker}' hello is stale (clock skew over {self.max_skew_s:.0f}s)")
        if h.nonce in self._seen:
            raise AuthError(f"worker '{h.worker}' hello replayed (nonce seen before)")
        self._seen[h.nonce] = None
        while len(self._seen) > self._remember:
            self._seen.popitem(last=False)

    def welcome(self, h: Hello, session: str, heartbeat_interval: float, transport: str = "zmq") -> Welcome:
        """A signed Welcome answering a verified Hello."""
        mac = _mac(self.secret, "welcome", h.worker, session, repr(float(heartbeat_interval)), h.nonce, transport)
        return Welcome(worker=h.worker, session=session, heartbeat_interval=float(heartbeat_interval),
                       nonce=h.nonce, mac=mac, transport=transport)


def verify_welcome(secret: bytes, hello: Hello, w: Welcome) -> None:
    """Worker side: raise AuthError unless `w` answers `hello` and is signed with the shared secret."""
    if not isinstance(w, Welcome):
        raise AuthError(f"expected a Welcome, got {type(w).__name__}")
    want = _mac(secret, "welcome", w.worker, w.session, repr(float(w.heartbeat_interval)), w.nonce, w.transport)
    if w.nonce != hello.nonce or w.worker != hello.worker or not _same_mac(w.mac, want):
        raise AuthError("coordinator failed authentication: its Welcome is not signed with our shared secret")
