"""JSON <-> tensors for the native endpoint: a tensor is {"dtype", "shape", "data": base64 of raw bytes}."""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from mstar_core.errors import RequestError
from mstar_core.sampling import is_integer

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}
_TENSOR_KEYS = {"dtype", "shape", "data"}
MAX_DEPTH = 32
MAX_DIMS = 8
_JSON_INT_MIN, _JSON_INT_MAX = -(2**63), 2**64 - 1  # the integers orjson can write
#: Far above what fits in a request body (whose size the server bounds), far below torch's stride overflow.
MAX_ELEMENTS = 2**40


def is_tensor_json(value: Any) -> bool:
    return isinstance(value, Mapping) and set(value) == _TENSOR_KEYS


def _checked_shape(shape: Any, where: str) -> list[int]:
    """A shape of at most MAX_DIMS non-negative ints whose volume (zeros counted as 1) is at most MAX_ELEMENTS.

    Counting zeros as 1 matters: `[0, 2**70]` holds no data, yet torch cannot even compute its strides.
    """
    if not isinstance(shape, list) or not all(is_integer(d) and d >= 0 for d in shape):
        raise RequestError(f"'{where}' must be a list of non-negative ints; got {_short(shape)}", param=where)
    if len(shape) > MAX_DIMS:
        raise RequestError(f"'{where}' has {len(shape)} dims; at most {MAX_DIMS} are accepted", param=where)
    volume = 1
    for d in shape:
        volume *= max(d, 1)
        if volume > MAX_ELEMENTS:
            raise RequestError(f"'{where}' {_short(shape)} is too large; at most {MAX_ELEMENTS} elements "
                               "(counting empty dimensions as 1) are accepted", param=where)
    return shape


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def decode_tensor(obj: Mapping[str, Any], where: str) -> torch.Tensor:
    """A tensor from its JSON form; RequestError naming `where` if it is malformed."""
    dtype = DTYPES.get(obj["dtype"]) if isinstance(obj["dtype"], str) else None
    if dtype is None:
        raise RequestError(f"'{where}.dtype' must be one of {', '.join(DTYPES)}; got {obj['dtype']!r}")
    shape = _checked_shape(obj["shape"], f"{where}.shape")
    if not isinstance(obj["data"], str):
        raise RequestError(f"'{where}.data' must be a base64 string of the raw little-endian bytes")
    try:
        raw = base64.b64decode(obj["data"], validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"'{where}.data' is not valid base64") from None
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = math.prod(shape)
    if len(raw) != count * itemsize:
        raise RequestError(
            f"'{where}.data' has {len(raw)} bytes; shape {shape} of {obj['dtype']} needs {count * itemsize}"
        )
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def decode_inputs(value: Any, where: str = "inputs", depth: int = 0) -> Any:
    """Walk JSON inputs, turning every tensor object into a torch tensor."""
    if depth > MAX_DEPTH:
        raise RequestError(f"'{where}' is nested more than {MAX_DEPTH} levels deep")
    if is_tensor_json(value):
        return decode_tensor(value, where)
    if isinstance(value, Mapping):
        return {k: decode_inputs(v, f"{where}.{k}", depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_inputs(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    return value


def encode_tensor(t: torch.Tensor) -> dict[str, Any]:
    t = t.detach().to("cpu").contiguous()
    name = _NAMES.get(t.dtype)
    if name is None:  # exotic dtypes travel as float32
        t, name = t.float(), "float32"
    data = t.view(torch.int16).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes()
    return {"dtype": name, "shape": list(t.shape), "data": base64.b64encode(data).decode()}


def encode_value(value: Any, depth: int = 0) -> Any:
    """JSON-able form of an output: tensors and arrays as tensor objects, containers recursively."""
    if depth > MAX_DEPTH:
        return repr(value)
    if isinstance(value, torch.Tensor):
        return encode_tensor(value)
    if isinstance(value, np.ndarray):
        return encode_tensor(torch.from_numpy(np.ascontiguousarray(value)))
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): encode_value(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encode_value(v, depth + 1) for v in value]
    if isinstance(value, int) and not _JSON_INT_MIN <= value <= _JSON_INT_MAX:
        return str(value)  # beyond what orjson writes: a string keeps every digit
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if hasattr(value, "items") and hasattr(value, "start"):  # a streaming Chunk
        return {"items": encode_value(list(value.items), depth + 1), "start": value.start}
    return repr(value)
