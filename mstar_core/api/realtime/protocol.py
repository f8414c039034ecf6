"""The wire side of the realtime protocol: ids, server events, and the error a bad client event gets."""

from __future__ import annotations

import base64
import binascii
import itertools
import uuid
from typing import Any

import numpy as np

from mstar_core.api.http.pieces import b64decode_pieces

_counter = itertools.count()


class ClientTooSlow(Exception):
    """The client read no events for `send_timeout` seconds while they waited: the session ends."""


def new_id(prefix: str) -> str:
    """An id in OpenAI's style (`item_...`, `resp_...`, `event_...`)."""
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


class EventError(Exception):
    """A client event the server cannot act on: becomes an `error` event; the session goes on."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.type = message, param, code, type


def event(kind: str, **fields: Any) -> dict[str, Any]:
    """A server event with a fresh `event_id`."""
    return {"type": kind, "event_id": f"event_{next(_counter):x}{uuid.uuid4().hex[:8]}", **fields}


def error_event(exc: EventError, client_event_id: str | None) -> dict[str, Any]:
    """The `error` event for `exc`; `event_id` inside it names the client event that caused it."""
    return event("error", error={"type": exc.type, "code": exc.code, "message": exc.message, "param": exc.param,
                                 "event_id": client_event_id})


def decode_pcm16(data: Any, where: str, max_bytes: int) -> np.ndarray:
    """int16 samples from base64 pcm16 (little-endian); bad base64, odd length or too much is an EventError."""
    if not isinstance(data, str):
        raise EventError(f"'{where}' must be a base64 string of pcm16 audio", param=where)
    if len(data) * 3 // 4 > max_bytes + 3:
        raise EventError(f"'{where}' carries about {len(data) * 3 // 4} bytes; one event takes at most {max_bytes}",
                         param=where, code="audio_too_large")
    try:
        raw = b64decode_pieces(data, validate=True)  # in pieces: a large append is decoded in a thread
    except (binascii.Error, ValueError):
        raise EventError(f"'{where}' is not valid base64", param=where, code="invalid_base64") from None
    if len(raw) % 2:
        raise EventError(f"'{where}' holds {len(raw)} bytes; pcm16 needs an even number", param=where,
                         code="invalid_audio")
    return np.frombuffer(raw, dtype="<i2").astype(np.int16)


def encode_pcm16(samples: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(samples, dtype="<i2").tobytes()).decode()
