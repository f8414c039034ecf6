"""Quantized linears for an LM node's weights: int8 weight-only, int8 with dynamic activations (CPU), fp8 (CUDA).

Every mode keeps one scale per output channel (`scale[n] = max |W[n, :]| / qmax`), so a row's error is
bounded by half a step of its own largest weight, not the matrix's.

* `int8` (weight-only): `y = (x @ q.T) * scale`, activations untouched. Three kernels compute it: M*'s own
  panel kernels (`panels`: `fp32_linear.cpp` for fp32 activations on AVX2 / AVX-512, `bf16_linear.cpp` for
  bf16 activations on AVX512-BF16; the int8 weight widened as it streams, so a decode step reads a quarter
  (half) of the bytes; a row is bitwise the same alone or batched), the default where they run;
  `torch._weight_int8pack_mm` (a fused int8-weight GEMM, vectorised for bf16 activations on AVX512); and
  dequantize-then-matmul (the int8 weight turned back into the activation dtype for one call).
* `int8_dynamic`: the same int8 weight and scales, activations quantized per call by FBGEMM
  (`quantized::linear_dynamic`, uint8 with one range per tensor, 7-bit): fast, but one range cannot hold
  SmolLM2's activation outliers (greedy agreement ~0.6, BENCHMARKS.md).
* `int8_token`: the same int8 weight, activations quantized per call with one scale per row (per token:
  `step[m] = max |x[m, :]| / 127`) into two int8 codes, the value and its residual (see `_per_token`), one
  int8 x int8 GEMM over both through oneDNN (`onednn::qlinear_pointwise`, VNNI where the CPU has it) with
  exact int32 sums, then each output row times its own step. A row's codes and sums never depend on the
  other rows, so a row computes bitwise the same alone or batched.
* `fp8`: e4m3 weights; on CUDA GPUs that have it `torch._scaled_mm` with per-row activation scales,
  elsewhere a dequantized matmul (the reference the tests check the CUDA path against).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.errors import ConfigError
from mstar_core.nn import bf16_linear, fp32_linear

#: The `quantize` values an LM node accepts (engine setting), and what each needs.
QUANT_MODES = ("int8", "int8_dynamic", "int8_token", "fp8")
INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def check_mode(mode: object, device: torch.device | str, where: str = "setting 'quantize'") -> str:
    """`mode` if it is a known quantization that runs on `device`; a `ConfigError` naming `where` otherwise."""
    if mode not in QUANT_MODES:
        raise ConfigError(f"{where} must be one of {list(QUANT_MODES)}, got {mode!r}")
    kind = torch.device(device).type
    if mode == "fp8" and kind != "cuda":
        raise ConfigError(f"{where}: fp8 runs on CUDA devices only (this node is on {kind}); use int8")
    if mode == "int8_dynamic" and (kind != "cpu" or "fbgemm" not in torch.backends.quantized.supported_engines):
        raise ConfigError(f"{where}: int8_dynamic needs FBGEMM on a CPU (this node is on {kind}); use int8")
    if mode == "int8_token" and (kind != "cpu" or not onednn_int8_available()):
        raise ConfigError(f"{where}: int8_token needs oneDNN's int8 linear on a CPU (this node is on {kind}); use int8")
    return mode


def per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: `(q [N, K] int8, scale [N] fp32)` with `weight ~= q * scale[:, None]`."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / INT8_MAX).clamp(min=1e-12)  # an all-zero row keeps a usable scale
    q = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def int8pack_is_fast(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether `_weight_int8pack_mm` has a vectorised CPU kernel for `dtype` activations here.

    AVX512 and bf16 only: with fp32 activations it is 6-9x (1 row) to 64x (32 rows) slower than the packed fp32
    GEMM even on AVX512 (benchmarks/quantization.py's kernel table), and on AVX2 it is slow for every dtype.
    """
    return dtype != torch.float32 and torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "AVX2", "NO AVX")


#: M*'s int8 panel kernel per activation dtype (`panels`)
_PANEL_KERNELS = {torch.float32: fp32_linear, torch.bfloat16: bf16_linear}


def int8_panels_available(dtype: torch.dtype) -> bool:
    """Whether M*'s int8 panel kernel runs here for `dtype` activations (fp32: AVX2 or AVX-512; bf16: AVX512-BF16)."""
    kernel = _PANEL_KERNELS.get(dtype)
    return kernel is not None and kernel.available()


def onednn_int8_available() -> bool:
    """Whether this torch has oneDNN's int8 linear (`onednn::qlinear_pointwise`), the `int8_token` kernel."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


def activation_qmax() -> int:
    """Largest activation code for `int8_token`: 127 with VNNI, 63 without.

    Without VNNI oneDNN multiplies u8 x s8 pairs into int16 sums that saturate (2 x 255 x 127 > 32767);
    7-bit activation codes keep every pair exact (2 x 127 x 127 < 32767), as FBGEMM's reduce_range does.
    """
    return 127 if torch.cpu._is_vnni_supported() else 63


class Int8Linear(nn.Module):
    """A linear with int8 per-channel weights: weight-only (`panels`, `int8pack`, `dequant`), FBGEMM dynamic, or oneDNN per-token."""

    KERNELS = ("panels", "int8pack", "dequant", "fbgemm", "onednn_token")

    def __init__(self, linear: nn.Linear, kernel: str | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = linear.weight.dtype
        q, scale = per_channel_int8(linear.weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", bias)
        device = linear.weight.device.type
        if kernel is None and device == "cpu":
            kernel = ("panels" if int8_panels_available(self.compute_dtype)
                      else "int8pack" if int8pack_is_fast(self.compute_dtype) else None)
        self.kernel = kernel or "dequant"
        if self.kernel not in self.KERNELS:
            raise ValueError(f"unknown int8 kernel {self.kernel!r}; use one of {self.KERNELS}")
        if self.kernel == "panels" and not int8_panels_available(self.compute_dtype):
            raise ValueError(f"the int8 panel kernel does not run here for {self.compute_dtype} activations")
        self.qmax = activation_qmax() if self.kernel == "onednn_token" else None
        self._scale_as: dict[torch.dtype, torch.Tensor] = {}
        self._prepacked = None  # the panels / fbgemm / onednn_token kernel's own weight layout: packed now, at load
        self._run = None  # the panel kernel's runner
        if self.kernel in ("panels", "fbgemm", "onednn_token"):
            self.prepacked()

    def prepacked(self):
        """The weight in the panels, fbgemm or onednn_token kernel's layout (packed once; copies pack again)."""
        if self._prepacked is None:
            q, scale = self.qweight, self.scale
            if self.kernel == "panels":
                panels = _PANEL_KERNELS[self.compute_dtype]
                self._prepacked, self._run = panels.pack(q), panels.int8_runner()
            elif self.kernel == "fbgemm":
                qw = torch.quantize_per_channel(q.float() * scale[:, None], scale.double(),
                                                torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
                self._prepacked = torch.ops.quantized.linear_prepack(qw, None if self.bias is None else self.bias.float())
            else:  # onednn_token: oneDNN's blocked int8 layout, chosen for a decode batch's row count
                self._prepacked = torch.ops.onednn.qlinear_prepack(q, [32, self.in_features])
                self._zero_points = torch.zeros(self.out_features, dtype=torch.long)
        return self._prepacked

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight this layer computes with, `q * scale`, as a dense `[N, K]` tensor."""
        return (self.qweight.float() * self.scale[:, None]).to(dtype or self.compute_dtype)

    def _scale(self, dtype: torch.dtype) -> torch.Tensor:
        got = self._scale_as.get(dtype)
        if got is None:
            got = self._scale_as[dtype] = self.scale.to(dtype)
        return got

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the kernel reads the scales as fp32 and the bias in x's dtype: a `.to()` since packing falls back below
        if (self.kernel == "panels" and x.dtype is self.compute_dtype and self.scale.dtype is torch.float32
                and (self.bias is None or self.bias.dtype is x.dtype) and x.is_cpu and not torch.is_grad_enabled()):
            packed = self.prepacked()
            flat = x.reshape(-1, self.in_features)
            out = self._run(flat if flat.stride(-1) == 1 else flat.contiguous(), packed, self.out_features, self.bias,
                            self.scale)
            return out.view(*x.shape[:-1], self.out_features)
        if self.kernel == "onednn_token":
            return self._per_token(x)
        if self.kernel == "fbgemm":
            flat = x.reshape(-1, self.in_features).float()
            out = torch.ops.quantized.linear_dynamic(flat, self.prepacked(), True)
            return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        if self.kernel == "int8pack":
            out = torch._weight_int8pack_mm(x.reshape(-1, self.in_features), self.qweight, self._scale(x.dtype))
            out = out.view(*x.shape[:-1], self.out_features)
            return out if self.bias is None else out + self.bias.to(x.dtype)
        # dequant: the int8 weight back in x's dtype for this call only (the scale folded into the weight)
        weight = self.qweight.to(x.dtype).mul_(self._scale(x.dtype)[:, None])
        return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))

    def _per_token(self, x: torch.Tensor) -> torch.Tensor:
        # Two int8 codes per activation, one GEMM: `hi = round(x / step)` and the residual `lo = round((x / step
        # - hi) * 2 * qmax)`, stacked as 2M rows, so `x ~= (hi + lo / (2 qmax)) * step`. One 8-bit code per row
        # cannot hold SmolLM2's outlier channels (the rest of a row rounds to a few levels: greedy agreement
        # ~0.92); the residual row makes the activation error ~1/65000 of the row's max, for a GEMM whose
        # weight bytes (a decode step's cost) are read once either way.
        packed = self.prepacked()
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        step = torch.linalg.vector_norm(flat, float("inf"), dim=1, keepdim=True, dtype=torch.float32)
        step = step.div_(self.qmax).clamp_(min=1e-30)  # (an all-zero row: codes all `zero`, any finite step)
        scaled = torch.div(flat, step)
        codes = torch.empty(2 * rows, self.in_features)
        hi = torch.round(scaled, out=codes[:rows])
        torch.sub(scaled, hi, out=codes[rows:]).mul_(2 * self.qmax).round_()
        # uint8 with a zero point (not int8: oneDNN runs an int8 source through a reference kernel, ~1000x slower)
        codes = codes.add_(self.qmax + 1).to(torch.uint8)
        # sum_k (codes - zero) * q (int32, exact) * scale[n]: the GEMM's activation scale is 1, the row's step comes after
        both = torch.ops.onednn.qlinear_pointwise(codes, 1.0, self.qmax + 1, packed, self.scale, self._zero_points, None,
                                                  1.0, 0, torch.float32, "none", [], "")
        out = torch.add(both[:rows], both[rows:], alpha=1 / (2 * self.qmax)).mul_(step)
        if self.bias is not None:
            out = out.add_(self.bias)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def __getstate__(self):
        state = dict(self.__dict__)
        # a torchbind object, an opaque oneDNN tensor or this machine's panels: copies (and the wire) never carry it
        state["_prepacked"] = state["_run"] = None
        return state

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, kernel={self.kernel}, bias={self.bias is not None}"


class Fp8Linear(nn.Module):
    """A linear with e4m3 per-channel weights: `torch._scaled_mm` on CUDA where it runs, else a dequantized matmul."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
        self.register_buffer("qweight", (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        # (_scaled_mm wants K and N multiples of 16; a GPU without fp8 GEMMs raises once, then dequantizes)
        self.scaled_mm = (linear.weight.device.type == "cuda" and self.in_features % 16 == 0
                          and self.out_features % 16 == 0)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight this layer computes with, `q * scale`, as a dense `[N, K]` tensor."""
        return (self.qweight.float() * self.scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.scaled_mm:
            try:
                out = self._scaled(flat)
            except RuntimeError:  # this GPU (or torch build) has no fp8 GEMM: dequantize from now on
                self.scaled_mm = False
            else:
                return out.view(*x.shape[:-1], self.out_features)
        out = F.linear(flat, self.dequantized(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return out.view(*x.shape[:-1], self.out_features)

    def _scaled(self, flat: torch.Tensor) -> torch.Tensor:
        # per-row activation scales (dynamic), per-column weight scales: both fp32, as _scaled_mm's rowwise mode wants
        x_scale = (flat.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
        xq = (flat.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out_dtype = flat.dtype if flat.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        out = torch._scaled_mm(xq, self.qweight.t(), scale_a=x_scale, scale_b=self.scale[None, :],
                               bias=None if self.bias is None else self.bias.to(out_dtype), out_dtype=out_dtype)
        return out.to(flat.dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, scaled_mm={self.scaled_mm}, bias={self.bias is not None}"


def _builder(mode: str, kernel: str | None) -> Callable[[nn.Linear], nn.Module]:
    if mode == "fp8":
        return Fp8Linear
    fixed = {"int8_dynamic": "fbgemm", "int8_token": "onednn_token"}.get(mode)
    return lambda linear: Int8Linear(linear, fixed or kernel)


def quantize_linears(module: nn.Module, mode: str, *, kernel: str | None = None, lm_head: bool = True) -> int:
    """Replace every `nn.Linear` in `module` (and a tied LM head's copy, when `lm_head`) by its `mode` form; returns how many.

    `kernel` picks the int8 weight-only kernel (`int8pack` or `dequant`; default by CPU). Linears on the
    meta device (weights another process holds) are left alone. A tied head (`TiedLMHead`) quantizes a
    copy of the embedding's weight for the logits; the embedding lookup keeps the full-precision table.
    """
    build = _builder(mode, kernel)
    count = 0
    for parent in list(module.modules()):
        own = getattr(parent, "quantize_own_linears", None)
        if own is not None:
            count += own(build) if lm_head else 0
            continue
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or child.weight.is_meta:
                continue
            if not lm_head and name == "lm_head":
                continue
            setattr(parent, name, build(child))
            count += 1
    return count
