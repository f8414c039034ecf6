"""LayerNorm over a decode step's few fp32 rows on CPU (`layer_norm.cpp`), where torch's op starts cold and a
recorded step (`tape.py`) needs a kernel it can replay.

`layer_norm` returns None where it does not apply (not fp32 on the CPU, autograd, `torch.compile` tracing, no weight
or bias, no compiler here) and the caller runs torch's op. It takes any number of rows (in parallel over rows past 8),
so a decoder row gets the same bits in any step; an encoder's thousands of rows are as fast through torch's op. The statistics are summed in double and the output rounded as torch's CPU kernel rounds it: bitwise
torch's where the two float statistics agree (most rows), within an ulp of them elsewhere (see the source).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import nn

from mstar_core.nn import native

SOURCE = Path(__file__).with_name("layer_norm.cpp")
_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64


def _function(variant: str | None):
    return native.function(SOURCE, "mstar_layer_norm_f32", [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float,
                                                            ctypes.c_int], None, variant)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
               variant: str | None = None) -> torch.Tensor | None:
    """`F.layer_norm(x, (dim,), weight, bias, eps)` of 2-D `x` (unit innermost stride); None: use torch's op."""
    if (weight is None or bias is None or x.dtype is not torch.float32 or not x.is_cpu or x.dim() != 2
            or x.stride(-1) != 1 or weight.dtype is not torch.float32
            or bias.dtype is not torch.float32 or not weight.is_contiguous() or not bias.is_contiguous()
            or weight.shape != (x.shape[1],) or bias.shape != weight.shape
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad))
            or torch.compiler.is_compiling()):
        return None
    fn = _function(variant)
    if fn is None:
        return None
    rows, dim = x.shape
    out = torch.empty((rows, dim), dtype=torch.float32)
    args = (x.data_ptr(), x.stride(0), weight.data_ptr(), bias.data_ptr(), out.data_ptr(), rows, dim, eps,
            torch.get_num_threads())
    fn(*args)
    if native.RECORDER is not None:  # (a tape recording this thread's kernel calls, see tape.py)
        native.RECORDER.record(fn, args)
    return out


def layer_norm_rows(module: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` (2-D rows): through the kernel where it applies, else torch's op."""
    if len(module.normalized_shape) == 1:
        done = layer_norm(x, module.weight, module.bias, module.eps)
        if done is not None:
            return done
    return module(x)
