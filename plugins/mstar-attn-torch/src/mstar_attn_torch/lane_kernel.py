"""The CPU decode-lane attention kernel (`lane_attention.cpp`): built once per machine, called through ctypes.

Decode attention over lanes is memory-bound. As torch ops a bf16 lane is widened to fp32 before two
batched matmuls (twice the bytes read, plus the scores' passes); the kernel reads each key and value
once in the lane's own dtype and accumulates in fp32, so a bf16 pool keeps bf16 lanes. It is plain C
ABI (no torch headers): `c++ -O3 -march=native -fopenmp` builds it in about a second into
`$MSTAR_KERNEL_CACHE` (default `~/.cache/mstar/kernels`), named by a hash of the source, the
compiler and the CPU's flags. Without a compiler, or with `MSTAR_LANE_KERNEL=0`, lanes attend
through torch ops as before.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("mstar.attn_torch.lane_kernel")

SOURCE = Path(__file__).with_name("lane_attention.cpp")
SWITCH_ENV = "MSTAR_LANE_KERNEL"  # "native" (default), "portable" or "0" (never use the kernel)
CACHE_ENV = "MSTAR_KERNEL_CACHE"

_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL | None] = {}  # by variant, once tried


class LanePlan(ctypes.Structure):
    """Mirror of `struct LanePlan` in lane_attention.cpp."""

    _fields_ = [
        ("rows", ctypes.c_void_p), ("lanes", ctypes.c_void_p), ("write_pos", ctypes.c_void_p), ("bound", ctypes.c_void_p),
        ("count", ctypes.c_int64), ("q_heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64),
        ("q_row", ctypes.c_int64), ("q_head", ctypes.c_int64), ("k_row", ctypes.c_int64), ("k_head", ctypes.c_int64),
        ("v_row", ctypes.c_int64), ("v_head", ctypes.c_int64),
        ("out_row", ctypes.c_int64), ("out_head", ctypes.c_int64),
        ("lane_stride", ctypes.c_int64), ("head_stride", ctypes.c_int64),
        ("scale", ctypes.c_float), ("threads", ctypes.c_int32),
    ]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


#: compiler flags per build: `native` for this CPU (its AVX-512 kernels where it has AVX-512), `portable` the
#: plain loops only (what a CPU without AVX-512 runs; tests compare the two)
FLAGS = {"native": ["-march=native"], "portable": ["-march=native", "-mno-avx512f"]}


def _build(compiler: str, variant: str) -> Path:
    source = SOURCE.read_bytes()
    flags = ["-O3", *FLAGS[variant], "-fopenmp", "-shared", "-fPIC"]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256(source + " ".join(flags).encode() + version.encode() + _cpu_flags().encode()).hexdigest()[:16]
    folder = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mstar" / "kernels")
    target = folder / f"lane_attention-{variant}-{digest}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    # built beside the target and renamed into place: processes building at once never load half a file
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        built = Path(scratch) / target.name
        subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built)], capture_output=True, text=True, check=True)
        os.replace(built, target)
    return target


def library(variant: str | None = None) -> ctypes.CDLL | None:
    """The loaded kernel library (`variant`: "native" or "portable"; default from $MSTAR_LANE_KERNEL), or None.

    None where it cannot be built here (logged once) or where `MSTAR_LANE_KERNEL=0`.
    """
    if variant is None:
        setting = os.environ.get(SWITCH_ENV, "native")
        if setting == "0":
            return None
        if setting not in FLAGS:
            raise ValueError(f"{SWITCH_ENV} must be 0, native or portable, got {setting!r}")
        variant = setting
    with _lock:
        if variant not in _libraries:
            _libraries[variant] = _load(variant)
        return _libraries[variant]


def _load(variant: str) -> ctypes.CDLL | None:
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        log.warning("no C++ compiler (%s): decode lanes attend through torch ops", os.environ.get("CXX", "c++"))
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler, variant)))
    except (OSError, subprocess.CalledProcessError) as exc:
        log.warning("decode-lane kernel not built (%s): lanes attend through torch ops", getattr(exc, "stderr", "") or exc)
        return None
    for name in ("mstar_lane_attend_f32", "mstar_lane_attend_bf16"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(LanePlan)] + [ctypes.c_void_p] * 6
    return lib


def kernel_for(dtype: torch.dtype, variant: str | None = None):
    """The kernel entry point for lanes of `dtype`, or None."""
    lib = library(variant)
    if lib is None:
        return None
    return {torch.float32: lib.mstar_lane_attend_f32, torch.bfloat16: lib.mstar_lane_attend_bf16}.get(dtype)


class LaneCall:
    """One step's lane attention through the kernel: its plan built at the first layer, then one call per layer."""

    @classmethod
    def for_plan(cls, plan, store: torch.Tensor) -> LaneCall | None:
        """The step's caller for `plan` (a backend `LanePlan`) over lane storage `store`, or None: use torch ops."""
        kernel = kernel_for(store.dtype) if store.device.type == "cpu" else None
        return None if kernel is None else cls(kernel, plan)

    def __init__(self, kernel, plan):
        self.kernel = kernel
        # row, lane, write position and bound of every row, kept alive for the struct's pointers
        self.index = torch.stack((plan.rows, plan.lanes, plan.pos, plan.bound)).to(torch.int64).contiguous()
        self.count = int(plan.rows.shape[0])
        self.plan: LanePlan | None = None
        self.layout: tuple | None = None

    def fits(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store_k: torch.Tensor) -> bool:
        """Whether the kernel takes these tensors (one dtype, unit innermost strides, the lane layout it reads)."""
        layout = (q.dtype, k.dtype, v.dtype, store_k.dtype, q.shape[1:], k.shape[1:], q.stride(), k.stride(), v.stride(),
                  store_k.stride())
        if layout == self.layout:
            return True
        dim = q.shape[-1]
        ok = (q.dtype == k.dtype == v.dtype == store_k.dtype and q.stride(-1) == 1 and v.stride(-1) == 1
              and k.stride(-1) == 1 and store_k.stride(-1) == 1 and store_k.stride(1) == dim and k.shape[-1] == dim)
        if ok:
            self.layout, self.plan = layout, None
        return ok

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store_k: torch.Tensor, store_v: torch.Tensor,
                 out: torch.Tensor, scale: float) -> None:
        """Append each row's new key and value to its lane and write its attention output into `out`'s row."""
        if self.plan is None or (self.plan.out_row, self.plan.out_head) != out.stride()[:2]:
            rows, lanes, pos, bound = (self.index[i].data_ptr() for i in range(4))
            self.plan = LanePlan(rows, lanes, pos, bound, self.count, q.shape[1], k.shape[1], q.shape[2],
                                 q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                 out.stride(0), out.stride(1),
                                 store_k.stride(0), store_k.stride(2), scale, torch.get_num_threads())
        self.plan.scale = scale
        failed = self.kernel(ctypes.byref(self.plan), q.data_ptr(), k.data_ptr(), v.data_ptr(), store_k.data_ptr(),
                             store_v.data_ptr(), out.data_ptr())
        if failed:
            raise RuntimeError(f"decode-lane kernel refused the step (code {failed}: head dim or group too large, or no memory)")
