"""Logits from an LM head's (or a tied embedding's) weight, completed over the vocabulary when that weight is split;
and the next token of each row of logits (`next_token.cpp`): the greedy one, read where the head wrote them, and a
draw at a temperature."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.nn import native

NEXT_TOKEN_SOURCE = Path(__file__).with_name("next_token.cpp")
_ARGMAX = {torch.float32: "mstar_argmax_rows_f32", torch.bfloat16: "mstar_argmax_rows_bf16"}
_ARGMAX_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
_DRAW_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
              ctypes.c_void_p, ctypes.c_int]


def lm_logits(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """`F.linear(hidden, head.weight)` (the plain GEMM, never a packed copy); all-gathered if `head` is vocab-split.

    A vocabulary-parallel embedding or head (`mstar_core.nn.parallel`) carries its `group`: its weight holds
    this rank's rows only, so the local logits are one rank's columns of the full row.
    """
    logits = F.linear(hidden, head.weight)
    group = getattr(head, "group", None)
    return logits if group is None else group.all_gather_last(logits)


def greedy_tokens(logits: torch.Tensor, variant: str | None = None) -> torch.Tensor | None:
    """Each row's `max(-1).indices` of `[rows, vocab]` fp32 or bf16 CPU logits (the first NaN, else the first
    maximum: torch's rule, bit for bit) as int64 `[rows]`, in one pass over the row as it is (no fp32 copy);
    None where the kernel does not apply (another device or dtype, a non-unit column stride, no kernel built)."""
    name = _ARGMAX.get(logits.dtype)
    if (name is None or not logits.is_cpu or logits.dim() != 2 or logits.stride(-1) != 1 or not logits.shape[1]
            or logits.requires_grad):
        return None
    fn = native.function(NEXT_TOKEN_SOURCE, name, _ARGMAX_ARGS, None, variant)
    if fn is None:
        return None
    rows = logits.shape[0]
    out = torch.empty(rows, dtype=torch.long)
    args = (logits.data_ptr(), logits.stride(0), rows, logits.shape[1], out.data_ptr(), torch.get_num_threads())
    fn(*args)
    if native.RECORDER is not None:  # (a tape recording this thread's kernel calls: a replayed head's tokens, tape.py)
        native.RECORDER.record(fn, args)
    return out


def draws(logits: torch.Tensor, variant: str | None = None) -> bool:
    """Whether `drawn_tokens` takes these logits (fp32 CPU rows with adjacent columns, the kernel built here)."""
    return _draw_kernel(logits, variant) is not None


def _draw_kernel(logits: torch.Tensor, variant: str | None):
    if (logits.dtype is not torch.float32 or not logits.is_cpu or logits.dim() != 2 or logits.stride(-1) != 1
            or not logits.shape[1] or logits.requires_grad):
        return None
    return native.function(NEXT_TOKEN_SOURCE, "mstar_draw_rows_f32", _DRAW_ARGS, ctypes.c_int, variant)


def drawn_tokens(logits: torch.Tensor, temperatures: list[float], u: torch.Tensor,
                 variant: str | None = None) -> torch.Tensor | None:
    """Each row's token drawn from `softmax(row / temperature)` by its uniform `u` (float64 `[rows]`, in [0, 1)): the
    first column whose running weight exceeds `u` of the row's total, as `sampler.draw_with` picks over the same
    distribution, in three passes over the row. fp32 CPU logits `[rows, vocab]`; int64 `[rows]`, -1 for a row whose
    maximum is not finite (NaN or an infinity: the caller's torch ops decide it); None where the kernel does not apply.
    """
    fn = _draw_kernel(logits, variant)
    if fn is None or u.dtype is not torch.float64 or not u.is_cpu:
        return None
    rows = logits.shape[0]
    temps = torch.tensor(temperatures, dtype=torch.float32)
    u = u.contiguous()
    out = torch.empty(rows, dtype=torch.long)
    if fn(logits.data_ptr(), logits.stride(0), rows, logits.shape[1], temps.data_ptr(), u.data_ptr(), out.data_ptr(),
          torch.get_num_threads()):
        return None  # (no memory for the weights)
    return out
