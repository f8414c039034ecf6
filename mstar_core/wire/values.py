"""Nested values (None, bool, int, float, str, list, dict[str, ...], tensor) <-> JSON plus tensor frames.

Encoding is explicit so decoding can never be ambiguous: a tensor becomes `{"$t": index}` (an index
into the message's tensor frames), a non-finite float becomes `{"$f": "nan" | "inf" | "-inf"}`, and a
user dict key starting with "$" is escaped with one more "$". Tuples travel as lists.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mstar_core.wire.errors import WireError
from mstar_core.wire.tensors import frame_to_tensor, tensor_to_frame

MAX_DEPTH = 64
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # what orjson can represent exactly
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class TensorSink:
    """Collects the tensors met while encoding: their headers go in the JSON, their frames after it."""

    def __init__(self, keep_device: bool = False):
        self.headers: list[dict[str, Any]] = []
        self.frames: list[Any] = []
        self.keep_device = keep_device

    def add(self, t: torch.Tensor) -> int:
        header, frame = tensor_to_frame(t, keep_device=self.keep_device)
        self.headers.append(header)
        self.frames.append(frame)
        return len(self.frames) - 1


def encode_value(v: Any, sink: TensorSink, where: str, depth: int = 0) -> Any:
    """Turn one nested value into its JSON-safe form; `where` names the field for error messages."""
    if depth > MAX_DEPTH:
        raise WireError(f"{where}: nesting deeper than {MAX_DEPTH}")
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        if not _INT_MIN <= v <= _INT_MAX:
            raise WireError(f"{where}: integer {v} does not fit in 64 bits")
        return int(v)
    if isinstance(v, float):
        if math.isfinite(v):
            return float(v)
        return {"$f": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
    if isinstance(v, torch.Tensor):
        return {"$t": sink.add(v)}
    if isinstance(v, (list, tuple)):
        return [encode_value(x, sink, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise WireError(f"{where}: dict keys must be str, got {type(k).__name__} {k!r}")
            out["$" + k if k.startswith("$") else k] = encode_value(x, sink, f"{where}.{k}", depth + 1)
        return out
    raise WireError(
        f"{where}: cannot send a {type(v).__name__}; allowed: None, bool, int, float, str, list, dict, torch.Tensor"
    )


def decode_value(v: Any, tensors: list[torch.Tensor], where: str, depth: int = 0) -> Any:
    """Inverse of `encode_value`; `tensors` are the message's decoded tensor frames in order."""
    if depth > MAX_DEPTH:
        raise WireError(f"{where}: nesting deeper than {MAX_DEPTH}")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [decode_value(x, tensors, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]
    if not isinstance(v, dict):
        raise WireError(f"{where}: unexpected JSON value of type {type(v).__name__}")
    if len(v) == 1 and "$t" in v:
        i = v["$t"]
        if type(i) is not int or not 0 <= i < len(tensors):
            raise WireError(f"{where}: tensor reference {i!r} out of range (message has {len(tensors)} tensors)")
        return tensors[i]
    if len(v) == 1 and "$f" in v:
        if v["$f"] not in _NONFINITE:
            raise WireError(f"{where}: bad non-finite float marker {v['$f']!r}")
        return _NONFINITE[v["$f"]]
    out = {}
    for k, x in v.items():
        if k.startswith("$"):
            if not k.startswith("$$"):
                raise WireError(f"{where}: unknown marker key {k!r}")
            k = k[1:]
        out[k] = decode_value(x, tensors, f"{where}.{k}", depth + 1)
    return out


def decode_tensors(headers: Any, frames: list[Any]) -> list[torch.Tensor]:
    """Rebuild every tensor frame of a message from its header list."""
    if not isinstance(headers, list):
        raise WireError("message field '$tensors' must be a list of tensor headers")
    if len(headers) != len(frames):
        raise WireError(f"message declares {len(headers)} tensors but carries {len(frames)} tensor frames")
    out = []
    for i, (h, f) in enumerate(zip(headers, frames, strict=True)):
        try:
            out.append(frame_to_tensor(h, f))
        except WireError as e:
            raise WireError(f"tensor {i}: {e}") from None
    return out
