"""fp32 linears on AVX2 or AVX-512 CPUs (`fp32_linear.cpp`): weights streamed at the memory's speed, any row count.

`pack` returns the weight (fp32, or int8 for the `int8` weight-only mode) in the kernel's panel layout (None where
the kernel is not built here: a CPU without AVX2 and FMA, or no compiler); `linear` runs one call into a fresh
output. Each row's result is the same whatever the call's row count, and the same in the AVX2 and AVX-512 builds
(the C++ file's comment says why).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from mstar_core.nn.panels import PanelKernel

SOURCE = Path(__file__).with_name("fp32_linear.cpp")
#: Most rows a call takes: any count (prefill chunks too; a row's result does not depend on it)
MAX_ROWS = sys.maxsize
_KERNEL = PanelKernel(SOURCE, "fp32", torch.float32)
pack, runner, int8_runner, linear = _KERNEL.pack, _KERNEL.runner, _KERNEL.int8_runner, _KERNEL.linear


def vector_bits(variant: str | None = None) -> int:
    """The kernel's vector width in this build: 512 (AVX-512), 256 (AVX2 and FMA), 0 (not built here)."""
    return _KERNEL.built(variant)


def available(variant: str | None = None) -> bool:
    """Whether the kernel is built here (AVX2 and FMA, or AVX-512)."""
    return vector_bits(variant) > 0
