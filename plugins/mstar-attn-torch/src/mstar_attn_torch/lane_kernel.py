"""The CPU decode-lane attention kernel (`lane_attention.cpp`), built and loaded by `mstar_core.nn.native`.

Decode attention over lanes is memory-bound. As torch ops a bf16 lane is widened to fp32 before two
batched matmuls (twice the bytes read, plus the scores' passes); the kernel reads each key and value
once in the lane's own dtype and accumulates in fp32, so a bf16 pool keeps bf16 lanes. Without a
compiler, or with `MSTAR_NATIVE_KERNELS=0`, lanes attend through torch ops as before.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from mstar_core.nn import native

SOURCE = Path(__file__).with_name("lane_attention.cpp")
_ENTRY_POINTS = {torch.float32: "mstar_lane_attend_f32", torch.bfloat16: "mstar_lane_attend_bf16"}


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
        ("slots", ctypes.c_void_p), ("pool_slot", ctypes.c_int64), ("pool_head", ctypes.c_int64),
        ("span", ctypes.c_int64), ("side", ctypes.c_void_p), ("lanes_end", ctypes.c_void_p),
    ]


def side_fetch_for(dtype: torch.dtype, rows: int, variant: str | None = None) -> int | None:
    """The address of the record the linears of `dtype` fetch from while they compute (`mstar::SideFetch`), where a
    step of `rows` lane rows should name its next layer's lanes there; else None.

    Only a batch's worth of rows: their linears are compute-bound (a weight read serves 2 x rows FLOPs), so the memory
    has room for the next layer's keys and values beside the weights; at a few rows the linears stream their weights
    at the memory's speed already, and fetching more beside them would slow them. Only the dtypes in
    `SIDE_FETCH_DTYPES`.
    """
    if rows < SIDE_FETCH_ROWS or dtype not in SIDE_FETCH_DTYPES:
        return None
    return side_fetch_record(dtype, variant)


def side_fetch_record(dtype: torch.dtype, variant: str | None = None) -> int | None:
    """The address of the `mstar::SideFetch` record the panel linears of `dtype` walk (None: no such kernel here)."""
    if dtype not in (torch.float32, torch.bfloat16):
        return None
    from mstar_core.nn import bf16_linear, fp32_linear

    source, prefix = (fp32_linear.SOURCE, "fp32") if dtype == torch.float32 else (bf16_linear.SOURCE, "bf16")
    entry = native.function(source, f"mstar_{prefix}_side_fetch", [], ctypes.c_void_p, variant)
    return None if entry is None else entry()


#: lane dtypes whose steps name the next layer's lanes to the linears. Not fp32: there a c=32 step's linears ran
#: slower by more than its attention gained (decode step 64.9 / 67.1 ms without, 69.7 / 71.0 ms with, alternated, on
#: the 2-core EPYC), where bf16's (half the linears' time, half the lanes' bytes) ran as fast or faster
SIDE_FETCH_DTYPES = (torch.bfloat16,)

#: fewest lane rows a step has for its lane attention to name the next layer's lanes to the linears (side_fetch_for)
SIDE_FETCH_ROWS = 24


def kernel_for(dtype: torch.dtype, variant: str | None = None):
    """The kernel entry point for lanes of `dtype` (`variant`: see `native.load`), or None."""
    if dtype not in _ENTRY_POINTS:
        return None
    return native.function(SOURCE, _ENTRY_POINTS[dtype], [ctypes.POINTER(LanePlan)] + [ctypes.c_void_p] * 8, ctypes.c_int,
                           variant)


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
        index = getattr(plan, "index", None)  # (a backend plan builds them as one tensor)
        if index is None or index.dtype != torch.int64 or not index.is_contiguous():
            index = torch.stack((plan.rows, plan.lanes, plan.pos, plan.bound)).to(torch.int64).contiguous()
        self.index = index
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
                 out: torch.Tensor, scale: float, pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        """Append each row's new key and value to its lane and write its attention output into `out`'s row.

        `pool`: the layer's paged keys and values `[slots, kv heads, D]` (the lanes' dtype, unit innermost stride) and
        each packed row's slot (int64): the new keys and values are stored there too, instead of by two `index_copy_`.
        """
        k_pool, v_pool = self.prepare(q, k, v, store_k, out, scale, pool)
        self.call(q.data_ptr(), k.data_ptr(), v.data_ptr(), store_k.data_ptr(), store_v.data_ptr(), k_pool, v_pool,
                  out.data_ptr())

    def prepare(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store_k: torch.Tensor, out: torch.Tensor, scale: float,
                pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> tuple[int | None, int | None]:
        """Set the plan for tensors laid out as these (strides, scale, pool strides); the pool's data pointers."""
        if self.plan is None or (self.plan.out_row, self.plan.out_head) != out.stride()[:2]:
            rows, lanes, pos, bound = (self.index[i].data_ptr() for i in range(4))
            self.plan = LanePlan(rows, lanes, pos, bound, self.count, q.shape[1], k.shape[1], q.shape[2],
                                 q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                 out.stride(0), out.stride(1),
                                 store_k.stride(0), store_k.stride(2), scale, torch.get_num_threads())
            self.plan.side = side_fetch_for(store_k.dtype, self.count)
            if self.plan.side:  # (the end of the lanes' memory: the kernel names no span past it)
                storage = store_k.untyped_storage()
                self.plan.lanes_end = storage.data_ptr() + storage.nbytes()
        self.plan.scale = scale
        self.plan_ref = ctypes.byref(self.plan)
        if pool is None:
            return None, None
        k_pool, v_pool, slots = pool
        self.plan.slots, self.plan.pool_slot, self.plan.pool_head = slots.data_ptr(), k_pool.stride(0), k_pool.stride(1)
        return k_pool.data_ptr(), v_pool.data_ptr()

    def call(self, q: int, k: int, v: int, store_k: int, store_v: int, k_pool: int | None, v_pool: int | None,
             out: int) -> None:
        """The kernel over data pointers laid out as `prepare` last saw (a layer after the first of a step: no checks)."""
        failed = self.kernel(self.plan_ref, q, k, v, store_k, store_v, k_pool, v_pool, out)
        if failed:
            raise RuntimeError(f"decode-lane kernel refused the step (code {failed}: head dim or group too large, or no memory)")
        if native.RECORDER is not None:  # (a tape recording this thread's kernel calls: the plan by its address)
            native.RECORDER.record(self.kernel, (ctypes.addressof(self.plan), q, k, v, store_k, store_v, k_pool, v_pool, out))
