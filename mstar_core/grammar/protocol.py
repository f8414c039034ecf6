"""The frames a server and its compile processes exchange: a small JSON header and raw bytes, nothing pickled.

A frame is the header's length (4 bytes, little-endian), the header (UTF-8 JSON object: `op` and plain fields) and
a body (bytes). The server sends a vocabulary once per process (`vocab`: its key, size and stop ids; the body is
each token's bytes behind its 4-byte length; answered `{"ok": true}` once loaded) and compiles (`compile`: the vocabulary's key and the grammar's kind;
the body is its source). The process answers each compile with `{"ok": true, "ms": ...}` and the compiled grammar
as xgrammar's JSON serialisation, or `{"ok": false, "error": reason}`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

_LEN = struct.Struct("<I")
#: Largest frame either side accepts: a compiled grammar's JSON for a large vocabulary is a few MB.
MAX_FRAME_BYTES = 256 * 1024 * 1024


class ProtocolError(Exception):
    """A frame that does not parse: the other side is not speaking this protocol (or died mid-frame)."""


def frame(header: dict[str, Any], body: bytes = b"") -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    return _LEN.pack(len(head)) + head + body


def unframe(data: bytes) -> tuple[dict[str, Any], bytes]:
    if len(data) < _LEN.size:
        raise ProtocolError("a frame shorter than its length prefix")
    (n,) = _LEN.unpack_from(data)
    if _LEN.size + n > len(data):
        raise ProtocolError("a frame whose header runs past its end")
    try:
        header = json.loads(data[_LEN.size:_LEN.size + n])
    except ValueError as exc:
        raise ProtocolError(f"a frame header that is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("a frame header that is not a JSON object")
    return header, data[_LEN.size + n:]


def pack_tokens(tokens: Sequence[bytes]) -> bytes:
    """Token byte strings, each behind its 4-byte length."""
    return b"".join(_LEN.pack(len(t)) + t for t in tokens)


def unpack_tokens(body: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(body):
        (n,) = _LEN.unpack_from(body, i)
        i += _LEN.size
        if i + n > len(body):
            raise ProtocolError("a token list whose last token runs past its end")
        out.append(body[i:i + n])
        i += n
    return out


def field(header: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """`header[name]`, which must be a `kind`: a typed read of a frame."""
    value = header.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ProtocolError(f"frame field {name!r} is {type(value).__name__}, not {kind}")
    return value
