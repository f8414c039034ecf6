"""Long C calls cut into pieces: base64 and JSON text of megabytes, the same bytes and text as one call gives.

One call on megabytes holds the GIL for its whole length, and so the event loop, whichever thread runs it; in
pieces, a thread running them lets the loop have its turns between two (each ~1 ms).
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

#: Base64 decoded this many characters at a time, and characters of a string encoded to JSON at a time.
B64_PIECE = JSON_PIECE = 1 << 20


def json_text(value: Any) -> str:
    """`json.dumps(value, ensure_ascii=False)`, the same text, with strings of `JSON_PIECE` characters or more
    encoded a piece at a time: one call for a 12 MB tool description holds the GIL (and so the loop, whichever
    thread runs it) for its whole length. Containers are walked here (they are small: their size is bounded)."""
    if isinstance(value, str):
        if len(value) < JSON_PIECE:
            return json.dumps(value, ensure_ascii=False)
        pieces = (json.encoder.encode_basestring(value[at:at + JSON_PIECE])[1:-1]
                  for at in range(0, len(value), JSON_PIECE))
        return '"' + "".join(pieces) + '"'
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return "{" + ", ".join(f"{json_text(k)}: {json_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(json_text(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def b64decode_pieces(text: str | bytes, *, validate: bool = False) -> bytes:
    """`base64.b64decode(text, validate=validate)` (the same bytes, the same errors) in pieces of `B64_PIECE`
    characters, so that a decode of megabytes in a thread lets the loop run between pieces. Pieces are decoded
    strictly; text they refuse (line breaks, stray characters, bad padding) is decoded whole, as it always was."""
    if isinstance(text, str):
        try:
            data = text.encode("ascii")
        except UnicodeEncodeError:
            return base64.b64decode(text, validate=validate)  # its own error for text that is not ASCII
    else:
        data = bytes(text)
    if len(data) <= B64_PIECE:
        return base64.b64decode(data, validate=validate)
    view = memoryview(data)
    try:
        return b"".join(base64.b64decode(view[at:at + B64_PIECE], validate=True)
                        for at in range(0, len(data), B64_PIECE))
    except binascii.Error:
        return base64.b64decode(data, validate=validate)
