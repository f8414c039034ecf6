"""Cross-attention labels of a `KVCacheEngine`: an encoder's output, turned once per request into per-layer keys and
values held in pool pages, that a decoder's layers attend to beside their own self-attention label (Whisper).

A call with input `cross_states` (`[frames, hidden]`, the encoder's output) and option `cross_label` (a name) has the
module turn the states into keys and values for every layer (`module.cross_kv`), batched across the requests that
brought states of the same length in one step, and stored in pages of the node's pool under that name. The label is
read-only: nothing appends to it, the scheduler never sees it (so it is never preempted: the decoder tokens that
attend to it are recomputed against it), and its pages go back to the pool when the request is released, finished or
cancelled, or when a later call brings new states under the same name (the next 30-second window). Every self label of
the request that named it attends to it: forks and `n` choices share the one copy.

A sequence remembers the cross label its calls named (`Sequence.cross_label`); its prefix-cache keys are salted with a
digest of the states, so two requests with the same decoder prompt over different audio never share pages.

The attention itself: the step's attention context is wrapped (`CrossAttentionContext`) so that each decoder layer,
besides `attend` (self-attention, the backend's), calls `cross_attend(layer, q, scale)`: every row attends to all of
its sequence's cross keys (no mask). Sequences of up to `KERNEL_MAX_ROWS` rows (decode steps, short prompts) in an
fp32 CPU pool go through one call of `mstar_core.nn.cross_attention.PagedCrossKernel` per layer, which reads their
keys and values in place, page by page (torch's attention over the pages' slot-major view copied them head-major
first: most of a Whisper decode row's cross-attention time); longer ones (and other pools) through torch's attention
one sequence at a time, over a view of the pages when they are consecutive. A row's result depends only on its own
sequence: batched equals alone, bit for bit, on either path.
"""

from __future__ import annotations

from hashlib import blake2b
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from mstar_core.errors import ModuleContractError, RequestError
from mstar_core.nn.cross_attention import KERNEL_MAX_ROWS, PagedCrossKernel
from mstar_kvcache.pool import PagePool
from mstar_kvcache.sequence import Sequence

#: The name under which a sequence's prefix-cache keys carry its cross label's digest (never a module input).
DIGEST_EXTRA = "@cross"


@attrs.define(eq=False)
class CrossLabel:
    """One request's encoder keys and values: `length` frames in `pages` (every layer's in each page)."""

    pages: list[int]
    length: int
    digest: bytes
    #: the flat slots of its keys: a slice when the pages are consecutive (a view, no gather), else an index tensor
    slots: slice | torch.Tensor


def parse_cross(inputs: Any, options: Any, node: str, hidden: int | None) -> tuple[str | None, torch.Tensor | None]:
    """A call's `cross_label` option and `cross_states` input, checked."""
    label = options.get("cross_label")
    states = inputs.get("cross_states")
    if (label is not None or states is not None) and options.get("write_cache", True) is False:
        raise RequestError(f"node '{node}': cross-attention (cross_label, cross_states) is for calls that write their "
                           "cache label; a read-only call attends to frozen self-attention labels only")
    if label is not None and (not isinstance(label, str) or not label):
        raise RequestError(f"node '{node}': option cross_label must be a non-empty string, got {label!r:.40}")
    if states is None:
        return label, None
    if label is None:
        raise RequestError(f"node '{node}': input cross_states needs option cross_label (the label that holds them)")
    if not isinstance(states, torch.Tensor) or states.dim() != 2 or not states.dtype.is_floating_point:
        shape = tuple(states.shape) if isinstance(states, torch.Tensor) else type(states).__name__
        raise RequestError(f"node '{node}': input cross_states must be a [frames, hidden] float tensor, got {shape}")
    if states.shape[0] < 1:
        raise RequestError(f"node '{node}': input cross_states has no frames")
    if hidden is not None and states.shape[1] != hidden:
        raise RequestError(f"node '{node}': input cross_states rows must have {hidden} features, got {states.shape[1]}")
    return label, states


def _digest(states: torch.Tensor) -> bytes:
    value = states.detach().cpu().contiguous()
    if value.dtype == torch.bfloat16:
        value = value.view(torch.int16)
    h = blake2b(str((value.dtype, tuple(value.shape))).encode(), digest_size=16)
    h.update(value.numpy().tobytes())
    return h.digest()


class CrossLabels:
    """The cross labels of one node, by (request, name), and the calls waiting for theirs to be written."""

    def __init__(self, node: str, module: Any, pool: PagePool, device: torch.device):
        self.node, self.module, self.pool, self.device = node, module, pool, device
        self.labels: dict[tuple[str, str], CrossLabel] = {}
        self.waiting: list[tuple[Any, Any]] = []  # (invocation, parsed call) whose states are not stored yet

    @property
    def num_pages(self) -> int:
        return sum(len(c.pages) for c in self.labels.values())

    def queue(self, invocation: Any, parsed: Any) -> None:
        """Hold a call that brings states until they are stored (at the next step, batched with the others)."""
        if getattr(self.module, "cross_kv", None) is None:
            raise ModuleContractError(f"node '{self.node}': module {type(self.module).__name__} has no cross_kv(states), "
                                      "so its calls cannot take cross_states", node=self.node, engine="kvcache",
                                      method="cross_kv")
        self.waiting.append((invocation, parsed))

    def store_waiting(self) -> tuple[list[tuple[Any, Any]], list[tuple[Any, BaseException]]]:
        """Store the waiting calls' states that fit in the pool: the calls now ready to attach, and the failures.

        States of equal length go through `cross_kv` as one batch. A call whose states do not fit waits for pages
        (requests finishing give theirs back); one that could never fit fails with a 413.
        """
        ready: list[tuple[Any, Any]] = []
        failed: list[tuple[Any, BaseException]] = []
        waiting, self.waiting = self.waiting, []
        fits: list[tuple[Any, Any]] = []
        budget = self.pool.num_available
        for inv, parsed in waiting:
            need = -(-parsed.cross_states.shape[0] // self.pool.page_size)
            old = self.labels.get((inv.request_id, parsed.cross_label))
            if need > self.pool.num_pages:
                failed.append((inv, RequestError(
                    f"node '{self.node}': the encoder output needs {need} KV pages but the pool has "
                    f"{self.pool.num_pages}; raise the node's num_pages (or kv_cache_bytes) setting", status=413)))
            elif need <= budget + (len(old.pages) if old is not None else 0) and not self.waiting:
                budget -= need
                fits.append((inv, parsed))
            else:  # FIFO: later arrivals wait behind it
                self.waiting.append((inv, parsed))
        by_length: dict[int, list[tuple[Any, Any]]] = {}
        for inv, parsed in fits:
            by_length.setdefault(parsed.cross_states.shape[0], []).append((inv, parsed))
        for group in by_length.values():
            try:
                with torch.inference_mode():
                    states = torch.stack([p.cross_states.to(self.device) for _, p in group])
                    kv = self.module.cross_kv(states)  # [batch, layers, 2, frames, kv_heads, head_dim]
                expected = (len(group), self.pool.kv.shape[0], 2, states.shape[1], *self.pool.kv.shape[4:])
                if tuple(kv.shape) != expected:
                    raise ModuleContractError(f"node '{self.node}': cross_kv returned {tuple(kv.shape)}, expected "
                                              f"{expected} (batch, layers, k/v, frames, kv heads, head dim)",
                                              node=self.node, engine="kvcache", method="cross_kv")
            except Exception as exc:
                failed.extend((inv, exc) for inv, _ in group)
                continue
            for i, (inv, parsed) in enumerate(group):
                self._store(inv.request_id, parsed.cross_label, kv[i], parsed.cross_states)
                ready.append((inv, parsed))
        return ready, failed

    def _store(self, request_id: str, name: str, kv: torch.Tensor, states: torch.Tensor) -> None:
        self.drop(request_id, name)
        length = kv.shape[2]
        pages = [self.pool.allocate() for _ in range(-(-length // self.pool.page_size))]
        self.pool.write_rows(pages, kv.to(self.pool.kv.dtype))
        size = self.pool.page_size
        if pages == list(range(pages[0], pages[0] + len(pages))):
            slots: slice | torch.Tensor = slice(pages[0] * size, pages[0] * size + length)
        else:
            index = torch.tensor(pages, dtype=torch.long).repeat_interleave(size) * size + torch.arange(size).repeat(len(pages))
            slots = index[:length].to(self.device)
        self.labels[request_id, name] = CrossLabel(pages, length, _digest(states), slots)

    def bind(self, seq: Sequence, parsed: Any, start: int) -> None:
        """Make the call's sequence attend to the cross label it names (its keys salted with the label's digest)."""
        if parsed.cross_label is None:
            return
        label = self.labels.get((seq.request_id, parsed.cross_label))
        if label is None:
            raise RequestError(f"node '{self.node}': request {seq.request_id} has no cross label "
                               f"'{parsed.cross_label}'; send cross_states with the call that first names it")
        seq.cross_label = parsed.cross_label
        if parsed.cross_states is not None or not any(e[2] == DIGEST_EXTRA for e in seq.extras):
            digest = torch.frombuffer(bytearray(label.digest), dtype=torch.uint8)
            seq.extras.append((start, start + len(parsed.ids), DIGEST_EXTRA, digest, False))

    def drop(self, request_id: str, name: str) -> None:
        label = self.labels.pop((request_id, name), None)
        if label is not None:
            for page in label.pages:
                self.pool.decref(page)

    def release(self, request_id: str) -> None:
        for key in [k for k in self.labels if k[0] == request_id]:
            self.drop(*key)
        self.waiting = [w for w in self.waiting if w[0].request_id != request_id]

    def request_ids(self) -> set[str]:
        return {inv.request_id for inv, _ in self.waiting}

    def close(self) -> None:
        for key in list(self.labels):
            self.drop(*key)
        self.waiting.clear()

    def context(self, work: list[tuple[Sequence, int]], inner: Any) -> Any:
        """The step's attention context, wrapped with cross-attention when some sequence of the step has a label."""
        if not self.labels or not any(seq.cross_label is not None for seq, _ in work):
            return inner
        spans, row = [], 0
        for seq, n in work:
            label = None if seq.cross_label is None else self.labels.get((seq.request_id, seq.cross_label))
            if label is not None:
                spans.append((row, n, label))
            row += n
        return CrossAttentionContext(inner, self.pool, spans, row)


class CrossAttentionContext:
    """A step's attention context plus `cross_attend`: each sequence's rows over its cross label's keys.

    Sequences with few rows (decode steps, short prompts) attend through the CPU kernel (`PagedCrossKernel`), which
    reads their keys in place from the pages; the others (and every sequence where the kernel is not built or the
    pool is not fp32 on the CPU) through torch's attention over a view (or gather) of their slots.
    """

    def __init__(self, inner: Any, pool: PagePool, spans: list[tuple[int, int, CrossLabel]], rows: int):
        kv = pool.kv
        self.inner, self.rows = inner, rows
        self.covered = sum(n for _, n, _ in spans)
        flat = kv.view(kv.shape[0], 2, -1, kv.shape[4], kv.shape[5])
        self.keys, self.values = flat[:, 0], flat[:, 1]  # [layers, slots, kv heads, head dim]
        few = [s for s in spans if 1 <= s[1] <= KERNEL_MAX_ROWS] if kv.dtype == torch.float32 and kv.is_cpu else []
        self.kernel = PagedCrossKernel.for_spans([(r, n, label.length, label.pages) for r, n, label in few],
                                                 pool.page_size)
        self.every_span = [(r, n, label.slots) for r, n, label in spans]
        self.spans = self.every_span if self.kernel is None else [s for s in self.every_span
                                                                  if not 1 <= s[1] <= KERNEL_MAX_ROWS]

    def __getattr__(self, name: str) -> Any:  # what else the backend's context offers
        return getattr(self.inner, name)

    def replay_layout(self) -> tuple[tuple, tuple[torch.Tensor, ...]] | None:
        """The inner context's replay layout (`mstar_kvcache.replay`) with this step's cross plan added, where every row
        of the step cross-attends through the kernel; None: the step cannot replay.

        A recorded step's cross-attention calls point at its kernel's plan, whose span table and page list a replay
        refreshes like the lanes' tensors (each sequence's pages change from request to request). So the layout's
        shape names what fixes those tensors' shapes and the rest of the plan: each span's first row, rows and frames
        (the page list's length follows from the frames), the page size, and the pool's keys (address and strides).
        It is not part of the storage: recordings of other row counts stay (a batch shrinks and grows again).
        """
        inner = getattr(self.inner, "replay_layout", None)
        step = inner() if inner is not None else None
        kernel = self.kernel
        if step is None or kernel is None or self.spans or self.covered != self.rows:
            return None
        storage, tensors, *shape = step
        cross = (kernel.page_size, kernel.spans_layout, self.keys.data_ptr(), self.keys.stride())
        return storage, (*tensors, kernel.table, kernel.pages), (*shape, cross)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return self.inner.attend(layer, q, k, v, scale)

    def cross_attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q `[T, Hq, D]` -> `[T, Hq, D]`: every row over all of its sequence's cross keys (rows without a label: 0)."""
        out = q.new_zeros(q.shape) if self.covered != q.shape[0] else q.new_empty(q.shape)
        keys, values = self.keys[layer], self.values[layer]
        kernel = self.kernel
        if kernel is not None and not kernel.fits(q, keys, values):  # (q in another dtype than the pool's): torch's
            self.kernel, self.spans, kernel = None, self.every_span, None
        if kernel is not None:
            kernel(q, keys, values, out, scale)
        for start, n, slots in self.spans:
            k, v = keys[slots].transpose(0, 1), values[slots].transpose(0, 1)  # [kv heads, frames, head dim]
            qh = q[start : start + n].transpose(0, 1).to(k.dtype)
            res = F.scaled_dot_product_attention(qh[None], k[None], v[None], scale=scale,
                                                 enable_gqa=qh.shape[0] != k.shape[0])[0]
            out[start : start + n] = res.transpose(0, 1).to(q.dtype)
        return out
