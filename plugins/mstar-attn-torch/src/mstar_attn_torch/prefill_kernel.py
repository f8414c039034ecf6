"""The CPU prefill attention kernel (`prefill_attention.cpp`), built and loaded by `mstar_core.nn.native`.

A short prompt's causal attention through torch's CPU flash kernel runs at ~20 GFLOP/s (its blocks are sized for
long sequences): ~13 ms of a 94-token prompt's ~130 ms to first token on SmolLM2-135M. The kernel computes the
same attention as two small register-blocked GEMMs per KV head and block of rows. It takes fp32 and bf16 chunks
whose head dim is a multiple of 64 on an AVX-512 build; anything else (or `MSTAR_NATIVE_KERNELS=0`, or no
compiler) keeps torch's kernel.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from mstar_core.nn import native

SOURCE = Path(__file__).with_name("prefill_attention.cpp")
_ENTRY_POINTS = {torch.float32: "mstar_prefill_attend_f32", torch.bfloat16: "mstar_prefill_attend_bf16"}


class PrefillPlan(ctypes.Structure):
    """Mirror of `struct PrefillPlan` in prefill_attention.cpp."""

    _fields_ = [
        ("rows", ctypes.c_int64), ("prefix", ctypes.c_int64),
        ("q_heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64),
        ("q_row", ctypes.c_int64), ("q_head", ctypes.c_int64), ("k_row", ctypes.c_int64), ("k_head", ctypes.c_int64),
        ("v_row", ctypes.c_int64), ("v_head", ctypes.c_int64), ("out_row", ctypes.c_int64), ("out_head", ctypes.c_int64),
        ("scale", ctypes.c_float), ("threads", ctypes.c_int32),
    ]


def kernel_for(dtype: torch.dtype, variant: str | None = None):
    """The entry point for chunks of `dtype` where this machine's build computes (`variant`: see `native.load`), or
    None."""
    if dtype not in _ENTRY_POINTS:
        return None
    vectorized = native.function(SOURCE, "mstar_prefill_vectorized", [], ctypes.c_int, variant)
    if vectorized is None or not vectorized():
        return None
    return native.function(SOURCE, _ENTRY_POINTS[dtype], [ctypes.POINTER(PrefillPlan)] + [ctypes.c_void_p] * 4,
                           ctypes.c_int, variant)


def attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, out: torch.Tensor, prefix: int, scale: float,
           variant: str | None = None) -> bool:
    """Causal attention of a chunk's rows into `out`, where the kernel takes them; False: run torch's instead.

    `q` and `out` are `[rows, q heads, D]`, `keys` and `vals` `[prefix + rows, kv heads, D]` (the chunk's own keys
    last): row i attends to keys `[0, prefix + i]`. Every tensor one dtype, unit innermost stride.
    """
    if native.RECORDER is not None or q.device.type != "cpu":  # (a tape recording a step replays only what it saw)
        return False
    rows, heads, dim = q.shape
    kv_heads = keys.shape[1]
    if (not rows or keys.shape[0] != prefix + rows or vals.shape != keys.shape or out.shape != q.shape
            or heads % kv_heads or keys.shape[2] != dim or dim % 64
            or not q.dtype == keys.dtype == vals.dtype == out.dtype
            or any(t.stride(-1) != 1 for t in (q, keys, vals, out))):
        return False
    kernel = kernel_for(q.dtype, variant)
    if kernel is None:
        return False
    plan = PrefillPlan(rows, prefix, heads, kv_heads, dim, q.stride(0), q.stride(1), keys.stride(0), keys.stride(1),
                       vals.stride(0), vals.stride(1), out.stride(0), out.stride(1), scale, torch.get_num_threads())
    return kernel(ctypes.byref(plan), q.data_ptr(), keys.data_ptr(), vals.data_ptr(), out.data_ptr()) == 0
