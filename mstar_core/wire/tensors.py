"""Tensors as a JSON-safe header plus one raw frame (the bytes of the storage span the view covers)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from mstar_core.wire.errors import WireError

#: dtype name on the wire -> torch dtype; the names are torch's own (`str(dtype)` minus "torch.").
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.uint16, torch.uint32, torch.uint64,
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
        torch.complex64, torch.complex128,
        torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    )
}
_HEADER_KEYS = {"dtype", "shape", "strides", "nbytes", "device"}
#: A non-contiguous view is sent as its storage span when the span is at most this many times its
#: element count (transposes, slices); otherwise (e.g. a tiny slice of a huge storage) it is compacted.
SPAN_SLACK = 2


def _span(t: torch.Tensor) -> int:
    """Number of storage elements between the view's first and last element, inclusive."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))


def tensor_to_frame(t: torch.Tensor, *, keep_device: bool = False) -> tuple[dict[str, Any], Any]:
    """Split a tensor into (header, frame); the frame aliases the tensor's memory when it can."""
    if not isinstance(t, torch.Tensor):
        raise WireError(f"expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided or t.is_quantized:
        raise WireError(f"only dense strided tensors travel on the wire, got layout {t.layout}")
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise WireError(f"dtype {t.dtype} is not supported on the wire; supported: {', '.join(DTYPES)}")
    device = str(t.device)
    if t.requires_grad:
        t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    numel = t.numel()
    if numel and not t.is_contiguous() and _span(t) <= SPAN_SLACK * numel:
        # Send the covering storage span and the real strides: no copy, and the receiver rebuilds the view.
        strides = list(t.stride())
        flat = torch.as_strided(t, (_span(t),), (1,), t.storage_offset())
    else:
        if not t.is_contiguous():
            t = t.contiguous()
        strides = list(t.stride())
        flat = t.reshape(-1)
    raw = flat.view(torch.uint8) if numel else flat.new_empty(0, dtype=torch.uint8)
    header = {"dtype": name, "shape": list(t.shape), "strides": strides, "nbytes": raw.numel(), "device": device}
    if raw.device.type != "cpu":
        if keep_device:
            return header, raw  # the tensor transport (NCCL) moves device frames itself
        raw = raw.cpu()
    return header, memoryview(raw.numpy()) if raw.numel() else b""


#: Bounds a header's dims and strides to what torch can index (a peer's numbers are not trusted).
MAX_DIMS = 64
_MAX_EXTENT = 2**62


def _ints(header: dict, key: str) -> list[int]:
    v = header.get(key)
    if not isinstance(v, list) or len(v) > MAX_DIMS or not all(type(x) is int and 0 <= x < _MAX_EXTENT for x in v):
        raise WireError(f"tensor header field '{key}' must be a list of at most {MAX_DIMS} non-negative ints "
                        f"below 2**62, got {str(v)[:80]}")
    return v


def frame_to_tensor(header: Any, frame: Any) -> torch.Tensor:
    """Rebuild a tensor from (header, frame) without copying; the tensor aliases the frame's buffer."""
    if not isinstance(header, dict) or set(header) != _HEADER_KEYS:
        got = sorted(header) if isinstance(header, dict) else type(header).__name__
        raise WireError(f"tensor header must have keys {sorted(_HEADER_KEYS)}, got {got}")
    dtype = DTYPES.get(header["dtype"]) if isinstance(header["dtype"], str) else None
    if dtype is None:
        raise WireError(f"unknown tensor dtype {header['dtype']!r} in header")
    shape, strides = _ints(header, "shape"), _ints(header, "strides")
    if len(shape) != len(strides):
        raise WireError(f"tensor header has {len(shape)} dims but {len(strides)} strides")
    if not isinstance(header["device"], str):
        raise WireError("tensor header field 'device' must be a string")
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = math.prod(shape)
    span = 0 if numel == 0 else 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    nbytes = header["nbytes"]
    if type(nbytes) is not int or nbytes != span * itemsize:
        raise WireError(f"tensor header nbytes={nbytes!r} does not match shape {shape} strides {strides} of {dtype}")
    if isinstance(frame, torch.Tensor):  # a device frame from a tensor transport
        got = frame.numel() if frame.dtype == torch.uint8 and frame.dim() == 1 else -1
        if got != nbytes:
            raise WireError(f"tensor frame must be a flat uint8 tensor of {nbytes} bytes")
        flat = frame.view(dtype) if nbytes else torch.empty(0, dtype=dtype, device=frame.device)
        return torch.as_strided(flat, shape, strides)
    try:
        size = memoryview(frame).nbytes
    except TypeError:
        raise WireError(f"tensor frame must be a bytes-like object, got {type(frame).__name__}") from None
    if size != nbytes:
        raise WireError(f"tensor frame has {size} bytes, header says {nbytes}")
    try:
        if numel == 0:
            return torch.empty_strided(shape, strides, dtype=dtype)
        with warnings.catch_warnings():
            # Read-only receive buffers (bytes, zmq frames) are fine: decoded tensors are documented read-only.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(frame, dtype=torch.uint8)
        return torch.as_strided(flat.view(dtype), shape, strides)
    except (RuntimeError, ValueError, OverflowError) as e:  # e.g. an extent torch cannot index
        raise WireError(f"tensor of shape {shape} cannot be built: {e}") from None
