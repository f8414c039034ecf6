"""The Python side of the panel-linear kernels (`fp32_linear.cpp`, `bf16_linear.cpp`): pack a weight, run a call.

Both sources export one set of entry points under their own prefix P: `mstar_P_linear_available` (nonzero where
built), `mstar_P_packed_elements` (elements of a packed `[n, k]` weight), `mstar_P_pack` and `mstar_P_pack_int8`,
`mstar_P_linear` and `mstar_P_int8_linear` (int8 weights, one fp32 scale per output, after the weight), whose last
argument is a hint naming the next call's weight (`mstar::NextWeight`, filled in by a tape: `tape.py`), and
`mstar_P_task_bytes` (that hint's stride for a weight).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from mstar_core.nn import native

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_RUN = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, ctypes.c_int, _PTR]  # x, x_row, packed, bias, out, ...
_SIGNATURES = {
    "linear_available": ([], ctypes.c_int),
    "packed_elements": ([_I64, _I64], _I64),
    "pack": ([_PTR, _I64, _I64, _I64, _PTR], None),
    "pack_int8": ([_PTR, _I64, _I64, _I64, _PTR], None),
    "linear": (_RUN, ctypes.c_int),
    "int8_linear": (_RUN[:3] + [_PTR] + _RUN[3:], ctypes.c_int),  # (the scales after the packed weight)
    "task_bytes": ([_I64, _I64, _I64, ctypes.c_int], _I64),  # n, k, bytes a weight element, threads
}


class PanelKernel:
    """One panel source's entry points for activations of `dtype` (`prefix`: its names' P)."""

    def __init__(self, source: Path, prefix: str, dtype: torch.dtype):
        self.source, self.prefix, self.dtype = source, prefix, dtype

    def _function(self, name: str, variant: str | None):
        return native.function(self.source, f"mstar_{self.prefix}_{name}", *_SIGNATURES[name], variant)

    def built(self, variant: str | None = None) -> int:
        """The build's answer to `available` (0: not built here)."""
        probe = self._function("linear_available", variant)
        return probe() if probe is not None else 0

    def pack(self, weight: torch.Tensor, variant: str | None = None) -> torch.Tensor | None:
        """A CPU weight `[out, in]` of the kernel's dtype (or int8) in its panel layout; None: the kernel does not run here."""
        entry = {self.dtype: "pack", torch.int8: "pack_int8"}.get(weight.dtype)
        if entry is None or weight.device.type != "cpu" or weight.dim() != 2 or weight.stride(-1) != 1:
            return None
        if not self.built(variant):
            return None
        n, k = weight.shape
        packed = torch.empty(self._function("packed_elements", variant)(n, k), dtype=weight.dtype)
        self._function(entry, variant)(weight.data_ptr(), weight.stride(0), n, k, packed.data_ptr())
        return packed

    def runner(self, variant: str | None = None):
        """`run(rows, packed, out_features, bias)` with its entry point resolved now (None: not built here)."""
        return native.linear_runner(self._function("linear", variant), self.dtype, f"{self.prefix} linear",
                                    task_bytes=self._function("task_bytes", variant))

    def int8_runner(self, variant: str | None = None):
        """`run(rows, packed, out_features, bias, scale)` over int8 panels; None: not built here."""
        return native.linear_runner(self._function("int8_linear", variant), self.dtype, f"{self.prefix} int8 linear",
                                    scaled=True, task_bytes=self._function("task_bytes", variant))

    def linear(self, rows: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None,
               variant: str | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
        """`rows @ weight.T + bias` for 2-D `rows` (unit inner stride) over a `pack`ed weight.

        An int8 weight's panels take `scale` (fp32, one per output): `rows @ (weight * scale[:, None]).T + bias`.
        """
        if packed.dtype == torch.int8:
            return self.int8_runner(variant)(rows, packed, out_features, bias, scale)
        return self.runner(variant)(rows, packed, out_features, bias)
