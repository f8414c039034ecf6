"""encode(msg) -> frames and decode(frames) -> msg: JSON header frame (orjson), then one raw frame per tensor.

Header frame: `{"type": tag, "fields": {...}, "tensors": [tensor headers]}`. Decoding validates the
tag, the exact field set and every field's type, and raises WireError naming what is wrong; it only
ever builds the registered message classes, never executes anything. Decoded tensors alias the
received buffers (zero copy): treat them as read-only, or clone them to keep or modify.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
import torch

from mstar_core.wire.errors import WireError
from mstar_core.wire.messages import MESSAGES, TAGS, check_field
from mstar_core.wire.values import TensorSink, decode_tensors, decode_value, encode_value

Frame = bytes | bytearray | memoryview
_TOP_KEYS = {"type", "fields", "tensors"}


def encode(msg: Any, *, keep_device: bool = False) -> list[Any]:
    """Encode a message; frame 0 is the JSON header, frames 1.. are tensor bytes (zero copy when contiguous).

    With `keep_device=True`, tensors on an accelerator stay there as flat uint8 tensor frames (for
    tensor transports such as NCCL); otherwise they are copied to host memory.
    """
    tag = TAGS.get(type(msg))
    if tag is None:
        raise WireError(f"{type(msg).__name__} is not a wire message; known: {', '.join(sorted(MESSAGES))}")
    sink = TensorSink(keep_device)
    fields = {}
    for spec in type(msg).__wire_fields__:
        value = getattr(msg, spec.name)
        check_field(spec, value, tag)
        fields[spec.name] = encode_value(value, sink, f"{tag}.{spec.name}") if spec.value else value
    try:
        header = orjson.dumps({"type": tag, "fields": fields, "tensors": sink.headers})
    except TypeError as e:  # e.g. a str with lone surrogates
        raise WireError(f"message '{tag}' cannot be encoded as JSON: {e}") from None
    return [header, *sink.frames]


def decode(frames: Sequence[Frame | torch.Tensor]) -> Any:
    """Decode frames from `encode` back into the message; raises WireError on anything malformed."""
    if isinstance(frames, (bytes, bytearray, memoryview)) or not frames:
        raise WireError("decode expects a non-empty list of frames (JSON header first)")
    try:
        top = orjson.loads(frames[0])
    except (orjson.JSONDecodeError, TypeError) as e:
        raise WireError(f"header frame is not valid JSON: {e}") from None
    if not isinstance(top, dict) or set(top) != _TOP_KEYS:
        got = sorted(top) if isinstance(top, dict) else type(top).__name__
        raise WireError(f"header frame must be an object with keys {sorted(_TOP_KEYS)}, got {got}")
    tag = top["type"]
    cls = MESSAGES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise WireError(f"unknown message type {tag!r}; known: {', '.join(sorted(MESSAGES))}")
    raw = top["fields"]
    if not isinstance(raw, dict):
        raise WireError(f"message '{tag}': 'fields' must be an object")
    specs = cls.__wire_fields__
    unknown = set(raw) - {s.name for s in specs}
    if unknown:
        raise WireError(f"message '{tag}' has unknown field(s): {', '.join(sorted(unknown))}")
    tensors = decode_tensors(top["tensors"], list(frames[1:]))
    kwargs = {}
    for spec in specs:
        if spec.name not in raw:
            if spec.required:
                raise WireError(f"message '{tag}' is missing field '{spec.name}'")
            continue
        value = raw[spec.name]
        if spec.value:
            value = decode_value(value, tensors, f"{tag}.{spec.name}")
        check_field(spec, value, tag)
        if spec.what == "a number" and value is not None:
            value = float(value)
        kwargs[spec.name] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise WireError(f"message '{tag}' is invalid: {e}") from None
