"""CPU linears with their weight prepacked for oneDNN once, instead of repacked by every fp32 GEMM call.

`F.linear` on the CPU (MKL sgemm) copies the weight into its blocked layout inside every call. For a
decode step's few rows that copy costs about as much as the arithmetic, the more so the wider the
weight: on the benchmark's AMD EPYC core (one thread, 32 rows) the 512 x 16384 LM head takes ~15 ms
through MKL and ~10.6 ms through oneDNN with the weight packed at load, the 512 x 3072 gate/up
~2.5 vs ~2.1 ms; at 4 rows 11.4 vs 5.2 ms for the LM head. Narrow weights (q/k/v, o, down) cost about
the same either way.

Every linear is packed, narrow ones included, for a second reason: batch invariance. oneDNN's packed
GEMM gives each row bitwise the same result whatever the call's row count from two rows up (checked for
2 to 700 rows, `tests/nn/test_packed.py`), while MKL's sgemm takes another path for one row (GEMV) than
for several, so a request decoded alone and the same request in a batch drift apart by ulps that, over a
49k vocabulary, can flip a greedy token. oneDNN has a one-row kernel of its own too: on an AVX512 EPYC a
1536-input linear's one-row result differs from the same row's in any larger call (~2e-6), on an AVX2
one it did not; so a one-row call runs as two (the row twice: the weight is read once either way, which
is what a one-row step costs). With every linear packed, the dense layers of a decode step compute a row
the same way alone or batched.

Under `torch.compile` a packed linear is one opaque op (`mstar_nn::packed_linear`) that runs the
eager packed GEMM, so a compiled step keeps it and inductor fuses the elementwise work around it.

The packed copy is extra memory (the weight stays, for `state_dict`, autograd and compiled graphs),
and its sums run in another order than MKL's (fp32 results differ by a few ulps, ~1e-6 relative).

bf16 weights are packed too where oneDNN has a bf16 GEMM on this CPU (AVX512-BF16, AMX, or AVX512BW
emulation; `bf16_packing_available` probes once): there the packed path is oneDNN's bf16 kernel (AMX
tiles where the CPU has them). An AVX2-only CPU has none, so its bf16 linears stay plain `F.linear`.

Where the CPU has AMX, a bf16 layer also keeps its weight in the tile layout of `amx_linear.cpp`, which runs
calls of up to `amx_linear.MAX_ROWS` rows (decode steps): torch's oneDNN call costs ~25 us of setup whatever
its size (121 calls a SmolLM2 step), and the kernel streams the weight faster (`benchmarks/decode_linears.py`,
2 cores: a step's linears 13.8 -> 11.5 ms at 2 rows, 16.7 -> 13.8 ms at 32). Its rows are batch-invariant from one row up;
longer calls (prefill chunks) keep oneDNN. That is a third copy of each bf16 weight.

Where the CPU has AVX2 and FMA (or AVX-512), an fp32 layer runs `fp32_linear.cpp` instead of oneDNN, for every row
count: oneDNN's GEMM reads a decode step's weights well below the memory's speed, and the kernel's rows are
batch-invariant from one row up (`benchmarks/decode_linears.py`: a SmolLM2 step's linears 1.2-1.9x faster at 1 to
32 rows on a 2-core AVX2 EPYC, 1.13-1.28x on an AVX-512 Zen 5, level or faster at 128-512). Likewise a bf16 layer on
an AVX512-BF16 CPU without AMX runs `bf16_linear.cpp` (vdpbf16ps panels; 1.26-1.39x oneDNN at 1 to 32 rows, 0.93x
at 512). Their panels replace oneDNN's packed copy.
"""

from __future__ import annotations

import sys
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.nn import amx_linear, bf16_linear, fp32_linear
from mstar_core.nn.replayable import weights_changed

#: Fewest output features of a linear to pack: every linear (for batch invariance, see the module docstring).
PACK_MIN_OUT = 1
#: The row count oneDNN's packed layout is chosen for (a full decode batch); any count runs.
PACK_ROWS_HINT = 32
#: M*'s own kernels per weight dtype, first choice first: the first whose `pack` runs on this CPU (None elsewhere) is
#: kept; each has `MAX_ROWS`
_OWN_KERNELS = {torch.bfloat16: (amx_linear, bf16_linear), torch.float32: (fp32_linear,)}


def packing_available() -> bool:
    """Whether this torch has oneDNN's prepacked linear (CPU builds with mkldnn)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_BF16_PACKING: list[bool] = []  # the probe's answer, once per process


def bf16_packing_available() -> bool:
    """Whether oneDNN packs and runs bf16 linears on this CPU (it refuses without AVX512BW or AVX-NE-CONVERT)."""
    if not _BF16_PACKING:
        ok = packing_available()
        if ok:
            try:  # (the reorder raises on a CPU without a bf16 path; cheaper to ask it than to parse CPU flags)
                torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), PACK_ROWS_HINT)
            except RuntimeError:
                ok = False
        _BF16_PACKING.append(ok)
    return _BF16_PACKING[0]


#: The weight dtypes a linear may be packed in (bf16 only where `bf16_packing_available`).
PACK_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Linear):
    """An `nn.Linear` that also keeps its weight packed for oneDNN and uses it in CPU inference (fp32, or bf16 with bf16 input).

    The packed copy is trusted only while the weight is the one packed (same storage, and the same
    in-place version counter, which `load_state_dict` and `copy_` bump); otherwise, and under autograd or `torch.compile`, it runs as a
    plain `nn.Linear`.
    """

    _packed: torch.Tensor | None = None
    # what the eager forward checks, read in one attribute lookup (a Module's __getattr__ costs ~1 us a name, and
    # a decode step runs 121 linears): (weight, oneDNN's packed weight or None, bias, dtype, data pointer, version,
    # own kernel's packed weight or None, the most rows it takes, its runner: `amx_linear`, `bf16_linear` or
    # `fp32_linear`'s)
    _fast: tuple | None = None

    def pack(self) -> None:
        """(Re)pack the current weight."""
        weight, bias = self.weight, self.bias
        own = run = None
        own_rows = 0
        if bias is None or (bias.dtype == weight.dtype and bias.is_contiguous()):
            for kernel in _OWN_KERNELS.get(weight.dtype, ()):
                own = kernel.pack(weight.detach())
                run = kernel.runner() if own is not None else None
                if run is not None:
                    own_rows = kernel.MAX_ROWS
                    break
        self._packed = None
        if own_rows < sys.maxsize:  # oneDNN for the rows the own kernel does not take
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
        self._fast = (weight, self._packed, bias, weight.dtype, weight.data_ptr(), weight._version, own, own_rows, run)
        weights_changed(self)  # a recorded step ran the previous pack (`mstar_core.nn.replayable`)

    @property
    def runs_own_kernel(self) -> bool:
        """Whether the current pack runs M*'s own kernel (for up to its most rows; oneDNN, a torch op, the rest)."""
        return self._fast is not None and self._fast[6] is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # first: data_ptr would break the graph
            if self._fast is None or torch.is_grad_enabled() or x.dtype != self.weight.dtype or x.device.type != "cpu":
                return F.linear(x, self.weight, self.bias)
            # one opaque op in the graph (inductor fuses around it), running this layer's packed weight
            return torch.ops.mstar_nn.packed_linear(x, self.weight, self.bias, _register(self))
        fast = self._fast
        if fast is None:
            return F.linear(x, self.weight, self.bias)
        weight, packed, bias, dtype, ptr, version, own, own_rows, run = fast
        # the pack is trusted only for the parameter it was made from, unchanged in place
        if (x.dtype is not dtype or torch.is_grad_enabled() or not x.is_cpu or self._parameters["weight"] is not weight
                or self._parameters["bias"] is not bias or weight._version != version or weight.data_ptr() != ptr):
            return F.linear(x, self.weight, self.bias)
        flat = x.dim() != 2
        rows = x.reshape(-1, x.shape[-1]) if flat else x
        if rows.shape[0] <= own_rows:  # the own kernel (AMX tiles for a decode step's rows; fp32 or bf16 panels for any)
            out = run(rows if rows.stride(-1) == 1 else rows.contiguous(), own, self.out_features, bias)
        elif rows.shape[0] == 1:  # run as two rows: oneDNN's one-row kernel sums in another order on some CPUs
            out = torch.ops.mkldnn._linear_pointwise(torch.cat((rows, rows)), packed, bias, "none", [], "")[:1]
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1]) if flat else out

    def __getstate__(self):
        # the packed tensor is opaque (no storage to copy or pickle): copies run unpacked until packed again
        state = dict(self.__dict__)
        state.pop("_packed", None)
        state.pop("_fast", None)
        return state


_LAYERS: dict[int, weakref.ref] = {}  # key -> PackedLinear, for the compiled op


def _register(layer: PackedLinear) -> int:
    key = id(layer)
    if key not in _LAYERS or _LAYERS[key]() is not layer:
        _LAYERS[key] = weakref.ref(layer)
    return key


@torch.library.custom_op("mstar_nn::packed_linear", mutates_args=())
def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: int) -> torch.Tensor:
    """A `PackedLinear`'s eager forward inside a compiled graph (weight and bias passed for the graph's bookkeeping)."""
    ref = _LAYERS.get(key)
    layer = ref() if ref is not None else None
    if layer is None or layer.weight.data_ptr() != weight.data_ptr():  # (the graph may hand over an alias)
        return F.linear(x, weight, bias)
    return layer(x)


@_packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def pack_linears(module: nn.Module, min_out: int | None = None) -> int:
    """Pack every fp32 (or, where oneDNN runs it, bf16) CPU `nn.Linear` in `module` with at least `min_out` outputs; how many.

    `min_out` defaults to `PACK_MIN_OUT`.

    Each becomes a `PackedLinear` in place (same parameters, hooks and names). A no-op without oneDNN.
    """
    if not packing_available():
        return 0
    min_out = PACK_MIN_OUT if min_out is None else min_out
    count = 0
    for sub in module.modules():
        own = getattr(sub, "pack_own_linears", None)  # a linear over another module's weight (a tied LM head)
        if own is not None:
            count += own(min_out)
            continue
        if type(sub) not in (nn.Linear, PackedLinear) or sub.out_features < min_out:
            continue
        weight = sub.weight
        if weight.dtype not in PACK_DTYPES or weight.device.type != "cpu" or weight.is_meta:
            continue
        if weight.dtype == torch.bfloat16 and not bf16_packing_available():
            continue
        sub.__class__ = PackedLinear
        sub.pack()
        count += 1
    return count
