"""An authenticated channel for every control message after the Hello/Welcome handshake.

The handshake proves both sides hold the shared secret; this binds each later message to that
session, not to the sender's ZeroMQ routing id (which any peer can claim). Both sides derive one
key per direction from the secret and both nonces (the worker's Hello nonce, the coordinator's
session token), and every message travels as `[envelope, *frames]`:

    envelope = MAGIC (4) | session id (8) | sequence number (8, big endian) | tag (16)

The tag is keyed BLAKE2b over the session id, the sequence number, the frame count, every frame's
length, and the bytes of every frame shorter than `FULL_MAC_BYTES` (JSON headers, shared-memory
descriptors, small tensors). Longer frames (tensor payloads) are bound by their length only: the
tag on the header already proves who sent the message and the message is delivered whole, so a
peer without the key can neither forge nor splice one; changing bytes in flight takes a
man-in-the-middle, which loopback and IPC sockets rule out and CURVE encryption addresses on
other links, and hashing every KV transfer would cost about a second per GiB. A sequence number
must exceed the last one accepted (gaps are allowed: a ROUTER socket may drop at its high-water
mark), so a captured message cannot be replayed, and distinct keys per direction stop a message
from being reflected back to its sender.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Any

from mstar_core.wire.errors import AuthError

MAGIC = b"MSs1"  # a JSON header starts with "{", shared-memory tags with "mstar-": never confused
SESSION_BYTES = 8
TAG_BYTES = 16
ENVELOPE_BYTES = len(MAGIC) + SESSION_BYTES + 8 + TAG_BYTES
#: Frames shorter than this are authenticated byte for byte; longer ones by their length (see above).
FULL_MAC_BYTES = 64 * 1024


def new_session_id() -> str:
    """A fresh session token (hex): the coordinator's nonce, sent in the Welcome."""
    import secrets

    return secrets.token_hex(SESSION_BYTES)


def session_id_bytes(session: str) -> bytes:
    """The raw session id of a Welcome's session token; AuthError when it is not one."""
    try:
        raw = bytes.fromhex(session)
    except (ValueError, TypeError):
        raw = b""
    if len(raw) != SESSION_BYTES:
        raise AuthError(f"session token must be {2 * SESSION_BYTES} hex digits")
    return raw


def derive_keys(secret: bytes, hello_nonce: str, session: str) -> tuple[bytes, bytes]:
    """(worker -> coordinator key, coordinator -> worker key) for one session."""
    base = hmac.new(bytes(secret), b"\x1f".join([b"mstar-session", hello_nonce.encode(), session.encode()]),
                    hashlib.sha256).digest()
    return (hashlib.blake2b(b"worker->coordinator", key=base, digest_size=32).digest(),
            hashlib.blake2b(b"coordinator->worker", key=base, digest_size=32).digest())


def _tag(key: bytes, session: bytes, seq: int, frames: Sequence[Any]) -> bytes:
    h = hashlib.blake2b(key=key, digest_size=TAG_BYTES)
    h.update(session + seq.to_bytes(8, "big") + len(frames).to_bytes(4, "big"))
    for frame in frames:
        view = memoryview(frame)
        h.update(view.nbytes.to_bytes(8, "big"))
        if view.nbytes < FULL_MAC_BYTES:
            h.update(view)
    return h.digest()


def session_of(frames: Sequence[Any]) -> bytes | None:
    """The session id of a sealed message, or None when `frames` are not one (a Hello, or junk)."""
    if not frames:
        return None
    try:
        first = memoryview(frames[0])
    except TypeError:
        return None
    if first.nbytes != ENVELOPE_BYTES or bytes(first[: len(MAGIC)]) != MAGIC:
        return None
    return bytes(first[len(MAGIC): len(MAGIC) + SESSION_BYTES])


class Channel:
    """One end of a session: seals what it sends, opens (verifies) what it receives."""

    def __init__(self, session: bytes, send_key: bytes, recv_key: bytes):
        self.session = session
        self._send_key = send_key
        self._recv_key = recv_key
        self._sent = 0
        self._received = 0

    @classmethod
    def for_worker(cls, secret: bytes, hello_nonce: str, session: str) -> Channel:
        up, down = derive_keys(secret, hello_nonce, session)
        return cls(session_id_bytes(session), up, down)

    @classmethod
    def for_coordinator(cls, secret: bytes, hello_nonce: str, session: str) -> Channel:
        up, down = derive_keys(secret, hello_nonce, session)
        return cls(session_id_bytes(session), down, up)

    def seal(self, frames: Sequence[Any]) -> list[Any]:
        """`[envelope, *frames]` with the next sequence number; send them in the order sealed."""
        self._sent += 1
        tag = _tag(self._send_key, self.session, self._sent, frames)
        return [MAGIC + self.session + self._sent.to_bytes(8, "big") + tag, *frames]

    def open(self, frames: Sequence[Any]) -> list[Any]:
        """The frames a sealed message carries; AuthError if it is forged, altered, replayed or not ours."""
        if session_of(frames) != self.session:
            raise AuthError("message is not sealed for this session")
        head = bytes(memoryview(frames[0]))
        at = len(MAGIC) + SESSION_BYTES
        seq = int.from_bytes(head[at: at + 8], "big")
        body = list(frames[1:])
        if not hmac.compare_digest(head[at + 8:], _tag(self._recv_key, self.session, seq, body)):
            raise AuthError("message authentication failed (forged or altered)")
        if seq <= self._received:
            raise AuthError(f"message replayed (sequence {seq}, last accepted {self._received})")
        self._received = seq
        return body
