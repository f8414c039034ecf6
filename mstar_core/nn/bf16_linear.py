"""bf16 linears on AVX512-BF16 CPUs without AMX (`bf16_linear.cpp`): weights streamed at the memory's speed, any row count.

`pack` returns the weight (bf16, or int8 for the `int8` weight-only mode) in the kernel's panel layout (None where
the kernel is not built here: a CPU without AVX512-BF16, or no compiler); `linear` runs one call into a fresh
output. Each row's result is the same whatever the call's row count (the C++ file's comment says why).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from mstar_core.nn.panels import PanelKernel

SOURCE = Path(__file__).with_name("bf16_linear.cpp")
#: Most rows a call takes: any count (prefill chunks too; a row's result does not depend on it)
MAX_ROWS = sys.maxsize
_KERNEL = PanelKernel(SOURCE, "bf16", torch.bfloat16)
pack, runner, int8_runner, linear = _KERNEL.pack, _KERNEL.runner, _KERNEL.int8_runner, _KERNEL.linear


def available(variant: str | None = None) -> bool:
    """Whether the kernel is built here (AVX512-BF16)."""
    return bool(_KERNEL.built(variant))
