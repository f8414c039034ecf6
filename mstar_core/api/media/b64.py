"""Base64 payloads of request parts (images, audio, video), bounded before they are decoded."""

from __future__ import annotations

import base64
import binascii

from mstar_core.errors import RequestError


def b64_part(payload: str, what: str, field: str, max_bytes: int) -> bytes:
    """A base64 payload decoded, at most `max_bytes` (413 naming `field` beyond); `what` names it in a 400."""
    # bound the size before decoding, so an oversized part costs no copy
    if len(payload) * 3 // 4 > max_bytes + 3:
        raise RequestError(f"'{field}' is about {len(payload) * 3 // 4} bytes; this server takes at most {max_bytes} "
                           "bytes per part", status=413, param=field)
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        try:  # line-wrapped base64 is still base64
            raw = base64.b64decode("".join(payload.split()), validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(f"'{what}' is not valid base64", param=field) from None
    if len(raw) > max_bytes:
        raise RequestError(f"'{field}' is {len(raw)} bytes; this server takes at most {max_bytes} bytes per part",
                           status=413, param=field)
    if not raw:
        raise RequestError(f"'{what}' is empty", param=field)
    return raw
