"""Fused RMSNorm, residual add, SiLU-and-multiply and rotary embedding on CPU (`cpu_elementwise.cpp`): one pass each, not several torch ops.

Each returns None where it does not apply (not a CPU tensor, a dtype other than fp32 / bf16, mixed
dtypes, autograd, `torch.compile` tracing, no compiler here), and the caller runs its torch ops.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from mstar_core.nn import native

SOURCE = Path(__file__).with_name("cpu_elementwise.cpp")
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "mstar_rms_norm": [_PTR, _I64, _PTR, _PTR, _I64, _I64, ctypes.c_float, ctypes.c_int],
    "mstar_rms_norm_heads": [_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, ctypes.c_float, ctypes.c_int],
    "mstar_add_rms_norm": [_PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, ctypes.c_float, ctypes.c_int],
    "mstar_add": [_PTR, _PTR, _I64, _I64, _I64, ctypes.c_int],
    "mstar_silu_mul": [_PTR, _I64, _PTR, _I64, _I64, ctypes.c_int],
    "mstar_rotary": [_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, ctypes.c_int],
}


def _call(fn, *args) -> None:
    fn(*args)
    if native.RECORDER is not None:  # (a tape recording this thread's kernel calls, see tape.py)
        native.RECORDER.record(fn, args)


def _function(name: str, dtype: torch.dtype, variant: str | None = None):
    return native.function(SOURCE, f"{name}_{_SUFFIX[dtype]}", _SIGNATURES[name], None, variant)


_vectorized: dict[int, bool] = {}  # by id of an entry point (not hashable; libraries stay loaded): its build's answer


def _has_vector_exp(entry, variant: str | None) -> bool:
    """Whether `entry`'s build has the vector exp (asked of its library once)."""
    known = _vectorized.get(id(entry))
    if known is None:
        probe = native.function(SOURCE, "mstar_elementwise_vectorized", [], ctypes.c_int, variant)
        known = _vectorized[id(entry)] = bool(probe())
    return known


def _applies(first: torch.Tensor, second: torch.Tensor | None = None, third: torch.Tensor | None = None) -> bool:
    # (called per layer of every step: the tensors spelled out, no tuple or generator)
    dtype = first.dtype
    if (not first.is_cpu or dtype not in _SUFFIX or (second is not None and second.dtype is not dtype)
            or (third is not None and third.dtype is not dtype)):
        return False
    if torch.is_grad_enabled() and (first.requires_grad or (second is not None and second.requires_grad)
                                    or (third is not None and third.requires_grad)):
        return False
    return not torch.compiler.is_compiling()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, variant: str | None = None) -> torch.Tensor | None:
    """`weight * (x * rsqrt(mean(x^2) + eps))` over the last dim, as `RMSNorm` rounds it; None: use torch ops."""
    if not _applies(x, weight) or x.stride(-1) != 1 or weight.dim() != 1 or not weight.is_contiguous():
        return None
    if x.dim() == 3 and x.stride(1) == x.shape[2] and x.stride(0) != x.shape[1] * x.shape[2]:
        return _rms_norm_heads(x, weight, eps, variant)  # (heads of a fused qkv's view: no 2-D view of them)
    flat = x.dim() != 2
    rows = x.reshape(-1, x.shape[-1]) if flat else x  # (a copy only where the rows are not a view)
    fn = _function("mstar_rms_norm", x.dtype, variant)
    if fn is None:
        return None
    count, dim = rows.shape
    out = torch.empty((count, dim), dtype=x.dtype)  # (ints, not a torch.Size: a few microseconds less a call)
    _call(fn, rows.data_ptr(), rows.stride(0), weight.data_ptr(), out.data_ptr(), count, dim, eps, torch.get_num_threads())
    return out.view(x.shape) if flat else out


def _rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float, variant: str | None) -> torch.Tensor | None:
    fn = _function("mstar_rms_norm_heads", x.dtype, variant)
    if fn is None:
        return None
    rows, heads, dim = x.shape
    out = torch.empty((rows, heads, dim), dtype=x.dtype)
    _call(fn, x.data_ptr(), x.stride(0), x.stride(1), rows, heads, dim, weight.data_ptr(), out.data_ptr(), eps,
          torch.get_num_threads())
    return out


def add_rms_norm_(delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                  variant: str | None = None) -> torch.Tensor | None:
    """`residual + delta` written into `delta` (the caller's scratch), and `rms_norm` of that sum; None: use torch ops."""
    if (not _applies(delta, residual, weight) or delta.dim() != 2 or not delta.is_contiguous()
            or residual.shape != delta.shape or residual.stride(-1) != 1 or weight.dim() != 1 or not weight.is_contiguous()
            or weight.shape[0] != delta.shape[1]):
        return None
    fn = _function("mstar_add_rms_norm", delta.dtype, variant)
    if fn is None:
        return None
    count, dim = delta.shape
    out = torch.empty((count, dim), dtype=delta.dtype)
    _call(fn, delta.data_ptr(), residual.data_ptr(), residual.stride(0), weight.data_ptr(), out.data_ptr(), count, dim,
          eps, torch.get_num_threads())
    return out


def add_(acc: torch.Tensor, other: torch.Tensor, variant: str | None = None) -> bool:
    """`other + acc` written into `acc` (the caller's scratch, 2-D contiguous), as torch's add rounds; False: not run here."""
    if (not _applies(acc, other) or acc.dim() != 2 or not acc.is_contiguous() or other.shape != acc.shape
            or other.stride(-1) != 1):
        return False
    fn = _function("mstar_add", acc.dtype, variant)
    if fn is None:
        return False
    _call(fn, acc.data_ptr(), other.data_ptr(), other.stride(0), acc.shape[0], acc.shape[1], torch.get_num_threads())
    return True


def silu_mul(gate_up: torch.Tensor, width: int, variant: str | None = None) -> torch.Tensor | None:
    """`silu(gate_up[..., :width]) * gate_up[..., width:]`, as the two torch ops round it; None: use torch ops."""
    if not _applies(gate_up) or gate_up.dim() != 2 or gate_up.stride(-1) != 1 or gate_up.shape[-1] != 2 * width:
        return None
    fn = _function("mstar_silu_mul", gate_up.dtype, variant)
    if fn is None or not _has_vector_exp(fn, variant):
        return None  # (without AVX-512 its exp is scalar: slower than torch's)
    count = gate_up.shape[0]
    out = torch.empty((count, width), dtype=gate_up.dtype)
    _call(fn, gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), count, width, torch.get_num_threads())
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, variant: str | None = None) -> bool:
    """`apply_rotary(x, cos, sin)` written into `x` `[T, H, D]` itself, as its torch ops round; False: not run here."""
    if (not _applies(x) or x.dim() != 3 or x.stride(-1) != 1 or cos.dtype != torch.float32 or sin.dtype != torch.float32
            or cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != x.shape[0] or cos.shape[1] % 2
            or cos.shape[1] > x.shape[2] or not cos.is_contiguous() or not sin.is_contiguous() or cos.device != x.device):
        return False
    fn = _function("mstar_rotary", x.dtype, variant)
    if fn is None:
        return False
    _call(fn, x.data_ptr(), x.stride(0), x.stride(1), x.shape[0], x.shape[1], cos.shape[1], cos.data_ptr(), sin.data_ptr(),
          torch.get_num_threads())
    return True
