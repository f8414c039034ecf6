"""The CPU prefill attention kernel (`prefill_attention.cpp`), built and loaded by `mstar_core.nn.native`.

A short prompt's causal attention through torch's CPU flash kernel runs at ~20 GFLOP/s (its blocks are sized for
long sequences): ~13 ms of a 94-token prompt's ~130 ms to first token on SmolLM2-135M. The kernel computes the
same attention as two small register-blocked GEMMs per KV head and block of rows. It takes fp32 and bf16 chunks
whose head dim is a multiple of 64 on an AVX-512 build; anything else (or `MSTAR_NATIVE_KERNELS=0`, or no
compiler) keeps torch's kernel.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from mstar_core.nn import native

SOURCE = Path(__file__).with_name("prefill_attention.cpp")
_ENTRY_POINTS = {torch.float32: "mstar_prefill_attend_f32", torch.bfloat16: "mstar_prefill_attend_bf16"}


class PrefillPlan(ctypes.Structure):
    """Mirror of `struct PrefillPlan` in prefill_attention.cpp."""

    _fields_ = [
        ("rows", ctypes.c_int64), ("prefix", ctypes.c_int64),
        ("q_heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64),
        ("q_row", ctypes.c_int64), ("q_head", ctypes.c_int64), ("k_row", ctypes.c_int64), ("k_head", ctypes.c_int64),
        ("v_row", ctypes.c_int64), ("v_head", ctypes.c_int64), ("out_row", ctypes.c_int64), ("out_head", ctypes.c_int64),
        ("scale", ctypes.c_float), ("threads", ctypes.c_int32),
        ("store_slots", ctypes.c_void_p), ("k_store", ctypes.c_void_p), ("v_store", ctypes.c_void_p),
        ("store_row", ctypes.c_int64), ("store_head", ctypes.c_int64),
    ]


# entry points by (dtype, variant): looked up once, not twice a layer (two library lookups and a probe call, ~4 us)
_kernels: dict[tuple[torch.dtype, str | None], object] = {}


def kernel_for(dtype: torch.dtype, variant: str | None = None):
    """The entry point for chunks of `dtype` where this machine's build computes (`variant`: see `native.load`), or
    None."""
    variant = native.variant_from_env() if variant is None else variant
    key = (dtype, variant)
    if key not in _kernels:
        _kernels[key] = _lookup(dtype, variant)
    return _kernels[key]


def _lookup(dtype: torch.dtype, variant: str | None):
    if dtype not in _ENTRY_POINTS or variant is None:
        return None
    vectorized = native.function(SOURCE, "mstar_prefill_vectorized", [], ctypes.c_int, variant)
    if vectorized is None or not vectorized():
        return None
    return native.function(SOURCE, _ENTRY_POINTS[dtype], [ctypes.POINTER(PrefillPlan)] + [ctypes.c_void_p] * 4,
                           ctypes.c_int, variant)


def attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, out: torch.Tensor, prefix: int, scale: float,
           variant: str | None = None, store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> bool:
    """Causal attention of a chunk's rows into `out`, where the kernel takes them; False: run torch's instead.

    `q` and `out` are `[rows, q heads, D]`, `keys` and `vals` `[prefix + rows, kv heads, D]` (the chunk's own keys
    last): row i attends to keys `[0, prefix + i]`. Every tensor one dtype, unit innermost stride. `store`: the
    pool's keys and values (`[slots, kv heads, D]`) and the chunk's rows' slots (int64 `[rows]`): where the kernel
    runs it also writes the chunk's own keys and values there (False: the caller writes them; the same values over
    any the kernel wrote before it gave up).
    """
    if native.RECORDER is not None or q.device.type != "cpu":  # (a tape recording a step replays only what it saw)
        return False
    rows, heads, dim = q.shape
    kv_heads = keys.shape[1]
    if (not rows or keys.shape[0] != prefix + rows or vals.shape != keys.shape or out.shape != q.shape
            or heads % kv_heads or keys.shape[2] != dim or dim % 64
            or not q.dtype == keys.dtype == vals.dtype == out.dtype
            or q.stride(-1) != 1 or keys.stride(-1) != 1 or vals.stride(-1) != 1 or out.stride(-1) != 1):
        return False
    kernel = kernel_for(q.dtype, variant)
    if kernel is None:
        return False
    plan = PrefillPlan(rows, prefix, heads, kv_heads, dim, q.stride(0), q.stride(1), keys.stride(0), keys.stride(1),
                       vals.stride(0), vals.stride(1), out.stride(0), out.stride(1), scale, torch.get_num_threads())
    if store is not None:
        k_store, v_store, slots = store
        if (k_store.dtype != q.dtype or v_store.dtype != q.dtype or k_store.shape[1:] != (kv_heads, dim)
                or v_store.shape != k_store.shape or v_store.stride() != k_store.stride() or k_store.stride(-1) != 1
                or slots.dtype != torch.int64 or slots.shape != (rows,) or slots.stride(0) != 1):
            return False
        plan.store_slots, plan.k_store, plan.v_store = slots.data_ptr(), k_store.data_ptr(), v_store.data_ptr()
        plan.store_row, plan.store_head = k_store.stride(0), k_store.stride(1)
    return kernel(ctypes.byref(plan), q.data_ptr(), keys.data_ptr(), vals.data_ptr(), out.data_ptr()) == 0


class PromptCalls:
    """A prompt step's fresh chunks through the kernel at every layer: the plans built at the first layer, then one call
    a chunk with the layer's pointers.

    `attend`'s checks, its plan and its keyword arguments cost ~15-20 us a layer in Python, a fifth to a quarter of what the
    kernel itself takes over a 94-token prompt (two threads); every layer of a step hands over tensors laid out alike
    (views of the fused projection's output at the same strides, the pool's per-layer views), so the checks and the
    plans are the first layer's, and a later layer's caller only compares its `layout_of` with the first one's.
    """

    def __init__(self, kernel, slots: torch.Tensor, calls: list):
        self.kernel = kernel
        self.slots = slots  # (kept alive: the plans point at it)
        self.calls = calls  # per chunk: (plan, its byref, byte offsets of the chunk's first q, k, v and out row)

    @staticmethod
    def layout_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_store: torch.Tensor, scale: float) -> tuple:
        """What a layer's tensors must share with the first layer's for its plans to hold."""
        return (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, k_store.dtype,
                k_store.shape[1:], k_store.stride(), scale, torch.get_num_threads())

    @classmethod
    def build(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor,
              slots: torch.Tensor, chunks: list[tuple[int, int]], scale: float,
              variant: str | None = None) -> PromptCalls | None:
        """The calls for fresh causal chunks `(start, rows)` of packed `q` `[T, q heads, D]`, `k` and `v` `[T, kv heads,
        D]`, each chunk's keys and values stored at its rows' `slots` of `k_store` / `v_store`; None where the kernel
        does not take them all (`attend`'s conditions)."""
        rows, heads, dim = q.shape
        kv_heads = k.shape[1]
        if (q.device.type != "cpu" or not chunks or k.shape[0] != rows or v.shape != k.shape or heads % kv_heads
                or k.shape[2] != dim or dim % 64 or not q.dtype == k.dtype == v.dtype == k_store.dtype == v_store.dtype
                or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1
                or k_store.shape[1:] != (kv_heads, dim) or v_store.shape != k_store.shape
                or v_store.stride() != k_store.stride() or k_store.stride(-1) != 1
                or slots.dtype != torch.int64 or slots.shape != (rows,) or slots.stride(0) != 1
                or any(n <= 0 or start < 0 or start + n > rows for start, n in chunks)):
            return None
        kernel = kernel_for(q.dtype, variant)
        if kernel is None:
            return None
        size = q.element_size()
        out_row, out_head = heads * dim, dim  # (the contiguous output `__call__` is given)
        calls = []
        for start, n in chunks:
            plan = PrefillPlan(n, 0, heads, kv_heads, dim, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                               v.stride(0), v.stride(1), out_row, out_head, scale, torch.get_num_threads())
            plan.store_slots = slots.data_ptr() + start * 8
            plan.store_row, plan.store_head = k_store.stride(0), k_store.stride(1)
            calls.append((plan, ctypes.byref(plan), start * q.stride(0) * size, start * k.stride(0) * size,
                          start * v.stride(0) * size, start * out_row * size))
        return cls(kernel, slots, calls)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_store: torch.Tensor,
                 v_store: torch.Tensor) -> torch.Tensor | None:
        """Every chunk's attention, into a new contiguous `[T, q heads, D]`, for tensors laid out as the first layer's
        (the same `layout_of`); None: the kernel did not run them (the caller's path then writes every output and store again)."""
        if native.RECORDER is not None:  # (a tape recording a step replays only what it saw)
            return None
        out = torch.empty(q.shape, dtype=q.dtype)
        qp, kp, vp, op = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        ks, vs = k_store.data_ptr(), v_store.data_ptr()
        kernel = self.kernel
        for plan, ref, dq, dk, dv, do in self.calls:
            plan.k_store, plan.v_store = ks, vs
            if kernel(ref, qp + dq, kp + dk, vp + dv, op + do) != 0:
                return None
        return out
