"""Exact GELU over a decode step's few fp32 rows on CPU (`gelu.cpp`), in place, where torch's op starts cold.

A one-row decode step streams its weights from memory between its small ops, which evicts torch's elementwise code
paths and tables: in a Whisper-base decode step (one thread) the six 2048-wide `gelu_` calls took 0.71 ms of device
thread CPU a step (~120 us each, ~8 us warm in a loop), the kernel 0.19 ms. `gelu_` returns None where it does not
apply (not fp32 on the CPU, autograd, `torch.compile` tracing, more than `MAX_ROWS` rows' worth, no compiler here) and
the caller runs torch's op, which is as fast for an encoder's thousands of rows.

The formula is torch's `approximate="none"`, erf by Abramowitz and Stegun 7.1.26: within ~1.5e-6 of `F.gelu`.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from mstar_core.nn import native

SOURCE = Path(__file__).with_name("gelu.cpp")
#: Most rows (of the last dim's width) a call takes here: decode steps and short prompts; more run torch's op
MAX_ROWS = 64


def _function(variant: str | None):
    return native.function(SOURCE, "mstar_gelu_f32", [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int], None, variant)


def gelu_(x: torch.Tensor, variant: str | None = None, max_rows: int | None = MAX_ROWS) -> torch.Tensor | None:
    """`F.gelu(x)` written into `x` (contiguous fp32) and returned; None: not run here, use torch's op.

    `max_rows` None: any number of rows (a caller whose rows must get the same bits whatever a step's size, as a
    decoder whose decode rows share steps with prompts).
    """
    if (x.dtype is not torch.float32 or not x.is_cpu or x.dim() < 1 or not x.is_contiguous()
            or (max_rows is not None and x.numel() > max_rows * x.shape[-1])
            or (torch.is_grad_enabled() and x.requires_grad)
            or torch.compiler.is_compiling()):
        return None
    fn = _function(variant)
    if fn is None:
        return None
    args = (x.data_ptr(), x.numel(), torch.get_num_threads())
    fn(*args)
    if native.RECORDER is not None:  # (a tape recording this thread's kernel calls, see tape.py)
        native.RECORDER.record(fn, args)
    return x
