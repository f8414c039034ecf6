"""bf16 linears on AVX512-BF16 CPUs without AMX (`bf16_linear.cpp`): weights streamed at the memory's speed, any row count.

`pack` returns the weight in the kernel's panel layout (None where the kernel is not built here: a CPU without
AVX512-BF16, or no compiler); `linear` runs one call into a fresh output. Each row's result is the same whatever
the call's row count (the C++ file's comment says why).
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch

from mstar_core.nn import native

SOURCE = Path(__file__).with_name("bf16_linear.cpp")
#: Most rows a call takes: any count (prefill chunks too; a row's result does not depend on it)
MAX_ROWS = sys.maxsize
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "mstar_bf16_linear_available": ([], ctypes.c_int),
    "mstar_bf16_packed_elements": ([_I64, _I64], _I64),
    "mstar_bf16_pack": ([_PTR, _I64, _I64, _I64, _PTR], None),
    "mstar_bf16_linear": ([_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, ctypes.c_int], ctypes.c_int),
    "mstar_bf16_pack_int8": ([_PTR, _I64, _I64, _I64, _PTR], None),
    "mstar_bf16_int8_linear": ([_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, ctypes.c_int], ctypes.c_int),
}


def _function(name: str, variant: str | None = None):
    return native.function(SOURCE, name, *_SIGNATURES[name], variant)


def available(variant: str | None = None) -> bool:
    """Whether the kernel is built here (AVX512-BF16)."""
    probe = _function("mstar_bf16_linear_available", variant)
    return probe is not None and bool(probe())


def pack(weight: torch.Tensor, variant: str | None = None) -> torch.Tensor | None:
    """A bf16 (or int8) CPU weight `[out, in]` in the kernel's panel layout, or None: the kernel does not run here."""
    entry = {torch.bfloat16: "mstar_bf16_pack", torch.int8: "mstar_bf16_pack_int8"}.get(weight.dtype)
    if entry is None or weight.device.type != "cpu" or weight.dim() != 2 or weight.stride(-1) != 1:
        return None
    if not available(variant):
        return None
    n, k = weight.shape
    packed = torch.empty(_function("mstar_bf16_packed_elements", variant)(n, k), dtype=weight.dtype)
    _function(entry, variant)(weight.data_ptr(), weight.stride(0), n, k, packed.data_ptr())
    return packed


def runner(variant: str | None = None):
    """`linear` with its entry point resolved now (None: not built here): what a `PackedLinear` keeps."""
    return native.linear_runner(_function("mstar_bf16_linear", variant), torch.bfloat16, "bf16 linear")


def int8_runner(variant: str | None = None):
    """`run(rows, packed, out_features, bias, scale)` over int8 panels (`pack` of an int8 weight); None: not built here."""
    return native.linear_runner(_function("mstar_bf16_int8_linear", variant), torch.bfloat16, "int8 linear", scaled=True)


def linear(rows: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None,
           variant: str | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """`rows @ weight.T + bias` for 2-D bf16 `rows` (unit inner stride) over a `pack`ed weight.

    An int8 weight's panels take `scale` (fp32, one per output): `rows @ (weight * scale[:, None]).T + bias`.
    """
    if packed.dtype == torch.int8:
        return int8_runner(variant)(rows, packed, out_features, bias, scale)
    return runner(variant)(rows, packed, out_features, bias)
