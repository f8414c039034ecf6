"""bf16 linears of up to `MAX_ROWS` rows on AMX tiles (`amx_linear.cpp`), with no per-call oneDNN setup.

`pack` returns the weight in the kernel's tile layout (None where the kernel is not built here or the CPU has
no AMX: the caller keeps oneDNN); `linear` runs one call into a fresh output. Each row's result is the same
whatever the call's row count (the module docstring of the C++ file says why).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from mstar_core.nn import native

SOURCE = Path(__file__).with_name("amx_linear.cpp")
#: Most rows a call takes: a decode step's (prefill chunks keep oneDNN, whose large-row GEMM blocks for cache)
MAX_ROWS = 32
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "mstar_amx_linear_available": ([], ctypes.c_int),
    "mstar_amx_packed_bytes": ([_I64, _I64], _I64),
    "mstar_amx_pack": ([_PTR, _I64, _I64, _I64, _PTR], None),
    # (the last argument, the panel kernels' next-weight hint, is taken for the shared signature and not used)
    "mstar_amx_linear": ([_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, ctypes.c_int, _PTR], ctypes.c_int),
}


def _function(name: str, variant: str | None = None):
    return native.function(SOURCE, name, *_SIGNATURES[name], variant)


def available(variant: str | None = None) -> bool:
    """Whether the kernel is built here with AMX and this process may use the tiles."""
    probe = _function("mstar_amx_linear_available", variant)
    return probe is not None and bool(probe())


def pack(weight: torch.Tensor, variant: str | None = None) -> torch.Tensor | None:
    """A bf16 CPU weight `[out, in]` in the kernel's tile layout, or None: the kernel does not run here."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2 or weight.stride(-1) != 1:
        return None
    if not available(variant):
        return None
    n, k = weight.shape
    packed = torch.empty(_function("mstar_amx_packed_bytes", variant)(n, k) // 2, dtype=torch.bfloat16)
    _function("mstar_amx_pack", variant)(weight.data_ptr(), weight.stride(0), n, k, packed.data_ptr())
    return packed


def runner(variant: str | None = None):
    """`linear` with its entry point resolved now (None: not built here): what a `PackedLinear` keeps."""
    return native.linear_runner(_function("mstar_amx_linear", variant), torch.bfloat16, "AMX linear")


def linear(rows: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None,
           variant: str | None = None) -> torch.Tensor:
    """`rows @ weight.T + bias` for 2-D bf16 `rows` (at most `MAX_ROWS`, unit inner stride) over a `pack`ed weight."""
    return runner(variant)(rows, packed, out_features, bias)
