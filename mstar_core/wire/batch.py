"""Several messages in one socket message: one send and one wake-up when many go out in the same turn.

A decode step of N requests produces N loop values for the serving process and N stream items for
a consumer's worker; sent one by one, each pays the socket, the sealing and the receiver's wake-up.
A batch is `[BATCH, counts, frames of message 1, frames of message 2, ...]`, where `counts` is a
JSON list of each message's frame count. No single message starts with `BATCH` (wire headers are
JSON objects, link tags start with "mstar-<link>", peer-line tags with "s" or a hex nonce).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from mstar_core.wire.errors import WireError

BATCH = b"mstar-batch/1"


def join_messages(messages: Sequence[list[Any]]) -> list[Any]:
    """One socket message carrying `messages` in order (a lone message goes as it is)."""
    if len(messages) == 1:
        return messages[0]
    return [BATCH, orjson.dumps([len(m) for m in messages]), *(frame for m in messages for frame in m)]


def split_messages(frames: Sequence[Any]) -> list[Sequence[Any]]:
    """The messages a socket message carries, in order; WireError when a batch's counts do not fit its frames."""
    if not frames or len(frames[0]) != len(BATCH) or bytes(frames[0]) != BATCH:
        return [frames]
    try:
        counts = orjson.loads(frames[1]) if len(frames) > 1 else None
    except (orjson.JSONDecodeError, TypeError) as exc:
        raise WireError(f"batch counts are not JSON: {exc}") from None
    if (not isinstance(counts, list) or not counts
            or not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in counts)):
        raise WireError("batch counts must be a non-empty list of positive frame counts")
    if sum(counts) != len(frames) - 2:
        raise WireError(f"batch counts name {sum(counts)} frames, the message carries {len(frames) - 2}")
    out, at = [], 2
    for count in counts:
        out.append(frames[at:at + count])
        at += count
    return out
