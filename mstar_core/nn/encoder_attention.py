"""An encoder window's bidirectional fp32 self-attention on the CPU (`encoder_attention.cpp`), every head in one call.

Whisper's encoder attends 1500 frames x heads x 64 in each of its layers; torch's CPU flash kernel ran it at about
77 GFLOP/s a core on the benchmark's EPYC, ~35% of the encoder's time, against ~95 for M*'s packed linears. The kernel
keeps a block of queries' scores against all keys in L2 (key-major, so the softmax needs no horizontal reductions)
and reads q, k and v in place from the projections' output (the chunks of the fused q/k/v GEMM, strided rows), writing
`[windows, frames, heads x head dim]`, the out projection's input, directly: no transposes or copies around it.

`attend` returns None where the kernel does not apply (not fp32 on the CPU, autograd, `torch.compile` tracing, a head
dim it does not take, no compiler, a build below AVX-512 unless asked for by name) and the caller runs torch's
attention.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from mstar_core.nn import native

SOURCE = Path(__file__).with_name("encoder_attention.cpp")


#: the vector width below which a caller that names no build level keeps torch's attention: the AVX2 build ran at
#: 57 GFLOP/s a core on the benchmark's EPYC against torch's 79 (which runs its own vector code there), AVX-512 at 96
MIN_LANES = 16


def _function(variant: str | None):
    fn = native.function(SOURCE, "mstar_encoder_attention_f32",
                         [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_int], ctypes.c_int,
                         variant)
    if fn is None or variant is not None:  # (a level asked for by name, as the tests do: run it)
        return fn
    lanes = native.function(SOURCE, "mstar_encoder_attention_lanes", [], ctypes.c_int, variant)
    return fn if lanes() >= MIN_LANES else None


def _fits(x: torch.Tensor, shape: torch.Size) -> bool:
    return x.dtype is torch.float32 and x.is_cpu and x.shape == shape and x.stride(-1) == 1


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, scale: float | None = None,
           variant: str | None = None) -> torch.Tensor | None:
    """`softmax(q k^T * scale) v` per head, no mask: q, k, v `[windows, frames, heads * head_dim]` (fp32, unit inner
    stride, any row strides) -> a new contiguous tensor of that shape; None: not run here, use torch's attention.
    `scale` defaults to `head_dim ** -0.5`, as `scaled_dot_product_attention`'s."""
    if (q.dim() != 3 or not _fits(q, q.shape) or not _fits(k, q.shape) or not _fits(v, q.shape)
            or q.shape[-1] % heads or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                                     or v.requires_grad))
            or torch.compiler.is_compiling()):
        return None
    fn = _function(variant)
    if fn is None:
        return None
    windows, frames, width = q.shape
    dim = width // heads
    out = torch.empty(q.shape, dtype=torch.float32)
    strides = torch.tensor([q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                            out.stride(0), out.stride(1)], dtype=torch.int64)
    args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), strides.data_ptr(), windows, frames, heads, dim,
            dim**-0.5 if scale is None else scale, torch.get_num_threads())
    if fn(*args):  # (a head dim the kernel does not take, or the portable build: torch's attention instead)
        return None
    return out
