"""fp32 linears on AVX2 or AVX-512 CPUs (`fp32_linear.cpp`): weights streamed at the memory's speed, any row count.

`pack` returns the weight in the kernel's panel layout (None where the kernel is not built here: a CPU without
AVX2 and FMA, or no compiler); `linear` runs one call into a fresh output. Each row's result is the same
whatever the call's row count, and the same in the AVX2 and AVX-512 builds (the C++ file's comment says why).
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch

from mstar_core.nn import native

SOURCE = Path(__file__).with_name("fp32_linear.cpp")
#: Most rows a call takes: any count (prefill chunks too; a row's result does not depend on it)
MAX_ROWS = sys.maxsize
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "mstar_fp32_linear_available": ([], ctypes.c_int),
    "mstar_fp32_packed_floats": ([_I64, _I64], _I64),
    "mstar_fp32_pack": ([_PTR, _I64, _I64, _I64, _PTR], None),
    "mstar_fp32_linear": ([_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, ctypes.c_int], ctypes.c_int),
    "mstar_fp32_pack_int8": ([_PTR, _I64, _I64, _I64, _PTR], None),
    "mstar_fp32_int8_linear": ([_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, ctypes.c_int], ctypes.c_int),
}


def _function(name: str, variant: str | None = None):
    return native.function(SOURCE, name, *_SIGNATURES[name], variant)


def vector_bits(variant: str | None = None) -> int:
    """The kernel's vector width in this build: 512 (AVX-512), 256 (AVX2 and FMA), 0 (not built here)."""
    probe = _function("mstar_fp32_linear_available", variant)
    return probe() if probe is not None else 0


def available(variant: str | None = None) -> bool:
    """Whether the kernel is built here (AVX2 and FMA, or AVX-512)."""
    return vector_bits(variant) > 0


def pack(weight: torch.Tensor, variant: str | None = None) -> torch.Tensor | None:
    """An fp32 (or int8) CPU weight `[out, in]` in the kernel's panel layout, or None: the kernel does not run here."""
    entry = {torch.float32: "mstar_fp32_pack", torch.int8: "mstar_fp32_pack_int8"}.get(weight.dtype)
    if entry is None or weight.device.type != "cpu" or weight.dim() != 2 or weight.stride(-1) != 1:
        return None
    if not available(variant):
        return None
    n, k = weight.shape
    packed = torch.empty(_function("mstar_fp32_packed_floats", variant)(n, k), dtype=weight.dtype)
    _function(entry, variant)(weight.data_ptr(), weight.stride(0), n, k, packed.data_ptr())
    return packed


def runner(variant: str | None = None):
    """`linear` with its entry point resolved now (None: not built here): what a `PackedLinear` keeps."""
    return native.linear_runner(_function("mstar_fp32_linear", variant), torch.float32, "fp32 linear")


def int8_runner(variant: str | None = None):
    """`run(rows, packed, out_features, bias, scale)` over int8 panels (`pack` of an int8 weight); None: not built here."""
    return native.linear_runner(_function("mstar_fp32_int8_linear", variant), torch.float32, "int8 linear", scaled=True)


def linear(rows: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None,
           variant: str | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """`rows @ weight.T + bias` for 2-D fp32 `rows` (unit inner stride) over a `pack`ed weight.

    An int8 weight's panels take `scale` (fp32, one per output): `rows @ (weight * scale[:, None]).T + bias`.
    """
    if packed.dtype == torch.int8:
        return int8_runner(variant)(rows, packed, out_features, bias, scale)
    return runner(variant)(rows, packed, out_features, bias)
