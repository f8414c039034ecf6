"""Cross-attention over packed tokens: a decoder layer's queries over an encoder's keys and values.

The keys and values come from the encoder's output once per request (`CrossAttention.project_kv`, which a module's
`cross_kv` stacks over its layers); the engine keeps them (the kvcache engine: in pool pages of a read-only cross
label) and the layer asks `context.cross_attend(layer, q, scale)` for the result, as self-attention asks
`context.attend`. `DenseCrossContext` is the uncached reference: one sequence, its encoder output at hand.

`PagedCrossKernel` is the CPU kernel (`cross_attention.cpp`) a paged engine runs for a step's sequences with few rows
(decode steps, short prompts): each reads its keys and values in place from the pool's pages, where torch's attention
over the pages' strided view copies them head-major first (~2.4x the time of a decode row's cross-attention, measured
at Whisper-base's 1500 frames x 8 heads x 64 on the benchmark's EPYC). Its tasks are chunks of 128 frames, every head
at once, so the pages stream front to back (Whisper-base, one decode row, 6 layers: 3.1-3.6 -> 1.8 ms on one thread,
1.5-2.0 -> 0.9-1.2 ms on two, against tasks of one head over all frames).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.nn import native

SOURCE = Path(__file__).with_name("cross_attention.cpp")
#: Most query rows of one sequence the kernel takes in a call (more: a prompt, which torch's GEMMs run better)
KERNEL_MAX_ROWS = 16
KERNEL_MAX_DIM = 256


class CrossAttentionContext(Protocol):
    """What a step's attention context offers a cross-attending layer (beside `attend`)."""

    def cross_attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q `[T, Hq, D]` -> `[T, Hq, D]`: each row over all of its sequence's encoder keys."""
        ...


class CrossAttention(nn.Module):
    """q from the decoder's rows, k and v from the encoder's output (HF names: q_proj, k_proj, v_proj, out_proj)."""

    def __init__(self, hidden: int, num_heads: int, layer_idx: int, *, k_bias: bool = False, bias: bool = True):
        super().__init__()
        self.num_heads, self.head_dim, self.layer_idx = num_heads, hidden // num_heads, layer_idx
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(hidden, hidden, bias=bias)
        self.k_proj = nn.Linear(hidden, hidden, bias=k_bias)
        self.v_proj = nn.Linear(hidden, hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)

    def project_kv(self, states: torch.Tensor) -> torch.Tensor:
        """Encoder output `[..., F, hidden]` -> `[..., 2, F, heads, head_dim]` (keys then values)."""
        shape = (*states.shape[:-1], self.num_heads, self.head_dim)
        return torch.stack((self.k_proj(states).view(shape), self.v_proj(states).view(shape)), dim=-4)

    def forward(self, x: torch.Tensor, context: CrossAttentionContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        out = context.cross_attend(self.layer_idx, q, self.scale)
        return self.out_proj(out.reshape(t, -1))


class DenseCrossContext:
    """The reference: one sequence's self-attention (`inner`, e.g. a `DenseKVCache`) and its encoder keys and values
    per layer (`kv`: `[layers, 2, F, heads, head_dim]`, as `cross_kv` gives for one request)."""

    def __init__(self, inner: object, kv: torch.Tensor):
        self.inner, self.kv = inner, kv

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return self.inner.attend(layer, q, k, v, scale)

    def cross_attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        k, v = self.kv[layer, 0].transpose(0, 1), self.kv[layer, 1].transpose(0, 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], scale=scale)
        return out[0].transpose(0, 1)


class _CrossPlan(ctypes.Structure):
    """Mirror of `struct CrossPlan` in cross_attention.cpp."""

    _fields_ = [("spans", ctypes.c_void_p), ("pages", ctypes.c_void_p), ("count", ctypes.c_int64),
                ("q_heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64),
                ("page_size", ctypes.c_int64), ("q_row", ctypes.c_int64), ("q_head", ctypes.c_int64),
                ("out_row", ctypes.c_int64), ("out_head", ctypes.c_int64), ("slot", ctypes.c_int64),
                ("head", ctypes.c_int64), ("scale", ctypes.c_float), ("threads", ctypes.c_int32)]


def cross_kernel(variant: str | None = None):
    """The kernel's entry point (`variant`: see `native.load`), or None where it is not built."""
    return native.function(SOURCE, "mstar_cross_attend_f32", [ctypes.c_void_p] * 5, ctypes.c_int, variant)


class PagedCrossKernel:
    """One step's cross-attention through the kernel for sequences whose keys sit in pool pages.

    `spans`: per sequence `(first packed row, rows, frames, pages)`; every sequence must have 1 to `KERNEL_MAX_ROWS`
    rows. Built once per step (the plan), then called once per layer with that layer's pool keys and values
    (`[slots, kv heads, head dim]` fp32, unit innermost stride, the same strides for both).
    """

    @classmethod
    def for_spans(cls, spans: list[tuple[int, int, int, list[int]]], page_size: int,
                  variant: str | None = None) -> PagedCrossKernel | None:
        kernel = cross_kernel(variant)
        return None if kernel is None or not spans else cls(kernel, spans, page_size)

    def __init__(self, kernel, spans: list[tuple[int, int, int, list[int]]], page_size: int):
        if any(not 1 <= rows <= KERNEL_MAX_ROWS for _, rows, _, _ in spans):
            raise ValueError(f"the cross-attention kernel takes 1 to {KERNEL_MAX_ROWS} rows per sequence")
        self.kernel, self.page_size = kernel, page_size
        table, pages, at = [], [], 0
        for row, rows, frames, own in spans:
            table.append((row, rows, frames, at))
            pages.extend(own)
            at += len(own)
        # kept alive for the plan's pointers
        self.table = torch.tensor(table, dtype=torch.int64).contiguous()
        self.pages = torch.tensor(pages, dtype=torch.int64).contiguous()
        self.count = len(spans)
        #: each span's first row, rows and frames: with the page size these fix the plan's tensors' shapes and every
        #: entry but the pages (what a recorded step's replay may refresh, see `mstar_kvcache.cross`)
        self.spans_layout = tuple((row, rows, frames) for row, rows, frames, _ in spans)
        self.plan: _CrossPlan | None = None

    def fits(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether the kernel takes these tensors (fp32 on the CPU, unit innermost strides, keys laid out as values)."""
        return (q.dtype == keys.dtype == values.dtype == torch.float32 and q.device.type == keys.device.type == "cpu"
                and q.stride(-1) == keys.stride(-1) == 1 and keys.stride() == values.stride()
                and q.shape[-1] == keys.shape[-1] <= KERNEL_MAX_DIM and q.shape[1] % keys.shape[1] == 0)

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor,
                 scale: float) -> None:
        """Write the spans' rows of `out` (`[T, Hq, D]`, unit innermost stride) from q `[T, Hq, D]`."""
        plan = self.plan
        if plan is None:
            plan = self.plan = _CrossPlan(self.table.data_ptr(), self.pages.data_ptr(), self.count, q.shape[1],
                                          keys.shape[1], q.shape[2], self.page_size, 0, 0, 0, 0, 0, 0, 0.0,
                                          torch.get_num_threads())
        plan.q_row, plan.q_head = q.stride(0), q.stride(1)
        plan.out_row, plan.out_head = out.stride(0), out.stride(1)
        plan.slot, plan.head = keys.stride(0), keys.stride(1)
        plan.scale = scale
        args = (ctypes.addressof(plan), q.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr())
        failed = self.kernel(*args)
        if failed:
            raise RuntimeError(f"cross-attention kernel refused the call (code {failed})")
        if native.RECORDER is not None:  # (a tape recording this thread's kernel calls)
            native.RECORDER.record(self.kernel, args)
