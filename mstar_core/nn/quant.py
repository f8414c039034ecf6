"""Quantized linears for an LM node's weights: int8 weight-only, int8 with dynamic activations (CPU), fp8 (CUDA).

Every mode keeps one scale per output channel (`scale[n] = max |W[n, :]| / qmax`), so a row's error is
bounded by half a step of its own largest weight, not the matrix's.

* `int8` (weight-only): `y = (x @ q.T) * scale`, activations untouched. Two kernels compute it:
  `torch._weight_int8pack_mm` (a fused int8-weight GEMM, vectorised for AVX512 and up) and
  dequantize-then-matmul (the int8 weight turned back into the activation dtype for one call). On an
  AVX2-only CPU both are slower than the fp32 GEMM (benchmarks/quantization.py measures them); the
  saving there is memory (a quarter of fp32's weight bytes).
* `int8_dynamic`: the same int8 weight and scales, activations quantized per call by FBGEMM
  (`quantized::linear_dynamic`, uint8 with a per-tensor range): the fast int8 path on x86 CPUs.
* `fp8`: e4m3 weights; on CUDA GPUs that have it `torch._scaled_mm` with per-row activation scales,
  elsewhere a dequantized matmul (the reference the tests check the CUDA path against).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.errors import ConfigError

#: The `quantize` values an LM node accepts (engine setting), and what each needs.
QUANT_MODES = ("int8", "int8_dynamic", "fp8")
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
    return mode


def per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: `(q [N, K] int8, scale [N] fp32)` with `weight ~= q * scale[:, None]`."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / INT8_MAX).clamp(min=1e-12)  # an all-zero row keeps a usable scale
    q = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def int8pack_is_fast() -> bool:
    """Whether `_weight_int8pack_mm` has its vectorised CPU kernel here (AVX512); on AVX2 it runs slower than fp32."""
    return torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "AVX2", "NO AVX")


class Int8Linear(nn.Module):
    """A linear with int8 per-channel weights: weight-only (`int8pack` or `dequant` kernel) or FBGEMM dynamic."""

    KERNELS = ("int8pack", "dequant", "fbgemm")

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
        self.kernel = kernel or ("int8pack" if device == "cpu" and int8pack_is_fast() else "dequant")
        if self.kernel not in self.KERNELS:
            raise ValueError(f"unknown int8 kernel {self.kernel!r}; use one of {self.KERNELS}")
        self._fbgemm = None
        if self.kernel == "fbgemm":
            qw = torch.quantize_per_channel(q.float() * scale[:, None], scale.double(), torch.zeros_like(scale, dtype=torch.long),
                                            0, torch.qint8)
            self._fbgemm = torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.float())
        self._scale_as: dict[torch.dtype, torch.Tensor] = {}

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight this layer computes with, `q * scale`, as a dense `[N, K]` tensor."""
        return (self.qweight.float() * self.scale[:, None]).to(dtype or self.compute_dtype)

    def _scale(self, dtype: torch.dtype) -> torch.Tensor:
        got = self._scale_as.get(dtype)
        if got is None:
            got = self._scale_as[dtype] = self.scale.to(dtype)
        return got

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "fbgemm":
            flat = x.reshape(-1, self.in_features).float()
            out = torch.ops.quantized.linear_dynamic(flat, self._fbgemm, True)
            return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        if self.kernel == "int8pack":
            out = torch._weight_int8pack_mm(x.reshape(-1, self.in_features), self.qweight, self._scale(x.dtype))
            out = out.view(*x.shape[:-1], self.out_features)
            return out if self.bias is None else out + self.bias.to(x.dtype)
        # dequant: the int8 weight back in x's dtype for this call only (the scale folded into the weight)
        weight = self.qweight.to(x.dtype).mul_(self._scale(x.dtype)[:, None])
        return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_fbgemm"] = None  # a torchbind object: copies (and the wire) never carry it
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
    return lambda linear: Int8Linear(linear, "fbgemm" if mode == "int8_dynamic" else kernel)


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
