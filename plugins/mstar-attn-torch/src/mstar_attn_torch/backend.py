"""Paged attention with `scaled_dot_product_attention`: keys gathered from pages by precomputed slot indices.

The gather indices and masks depend only on the step's layout, so they are built once per step
(in `TorchPagedContext.__init__`) and every layer reuses them. Decoding rows attend over their
sequence's decode lane (a contiguous copy of its keys, see `lanes.py`) when the backend keeps
lanes (on CPU by default), else over a per-layer gather of whole pages; prefill chunks run one
sequence at a time over their slots.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from mstar_attn_torch import lane_kernel, prefill_kernel
from mstar_attn_torch.lanes import DecodeLanes


class LanePlan(NamedTuple):
    """How one step's decoding rows use their lanes (same for every layer)."""

    rows: torch.Tensor  # packed row of each lane-decoding sequence
    lanes: torch.Tensor  # its lane
    pos: torch.Tensor  # where its new key goes in the lane
    count: int  # lanes attended over (0..count-1)
    width: int  # keys attended over per lane
    mask: torch.Tensor | None  # None when every lane has `width` keys
    whole: bool  # every row of the step decodes in a lane, and those lanes are exactly 0..count-1
    order: torch.Tensor | None  # with `whole`: the row serving each lane, unless lane l serves row l
    bound: torch.Tensor  # keys each row attends over, [0, bound) (the lane kernel's mask)
    index: torch.Tensor | None = None  # rows, lanes, pos and bound as one int64 tensor [4, rows] (theirs are its views)


class TorchPagedAttention:
    """The `torch` backend: works on any device torch runs on.

    `decode_lanes` (default: on for CPU) keeps contiguous per-sequence copies of decoding
    sequences' keys and values, at most as many bytes as the pool itself; on CPU a page gather
    per layer costs as much as the attention. Lanes of an fp32 or bf16 pool keep its dtype and are
    read by the lane kernel (`lane_kernel.py`); without it (no compiler), or for an fp16 pool, a
    half-precision pool gets fp32 lanes, so its decode attention runs as fp32 matmuls with no
    per-layer widening.
    """

    name = "torch"

    def __init__(self, device: torch.device | str = "cpu", decode_lanes: bool | None = None):
        self.device = torch.device(device)
        self.use_lanes = self.device.type == "cpu" if decode_lanes is None else decode_lanes
        self.lanes: DecodeLanes | None = None
        self._pages: tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    @staticmethod
    def available(device: torch.device | str) -> bool:
        """Whether the backend can run on `device` (always)."""
        return True

    def begin(self, batch: Any, kv: torch.Tensor) -> TorchPagedContext:
        """Attention context for one step; `batch` is a `mstar_kvcache.PagedBatch`, `kv` the pool tensor."""
        lanes = None
        if self.use_lanes and getattr(batch, "seq_ids", None) is not None:
            if self.lanes is None:
                # (within the pool's own bytes; fp32 lanes for a half-precision pool hold half its tokens)
                native = kv.device.type == "cpu" and lane_kernel.kernel_for(kv.dtype) is not None
                wide = kv.device.type == "cpu" and kv.dtype in (torch.bfloat16, torch.float16) and not native
                self.lanes = DecodeLanes(kv.numel() * kv.element_size(), torch.float32 if wide else None)
            lanes = self.lanes
        if self._pages is None or self._pages[0] is not kv:
            self._pages = (kv, page_views(kv))
        return TorchPagedContext(batch, kv, lanes, self._pages[1])

    def forget(self, seq_id: Hashable) -> None:
        """Drop per-sequence state of a sequence the engine freed."""
        if self.lanes is not None:
            self.lanes.forget(seq_id)


def page_views(kv: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the pool's keys and values as `[slots, kv heads, head dim]` views (the same every step)."""
    flat = kv.view(kv.shape[0], 2, -1, kv.shape[4], kv.shape[5])
    return [(flat[layer, 0], flat[layer, 1]) for layer in range(kv.shape[0])]


def _key_slots(batch: Any, seqs: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat cache slots `[len(seqs), length]` of each sequence's keys 0..length-1, and the key positions."""
    device = batch.page_table.device
    pos = torch.arange(length, device=device)
    table = batch.page_table[torch.tensor(seqs, device=device)] if len(seqs) != batch.num_seqs else batch.page_table
    pages = table[:, (pos // batch.page_size).clamp(max=table.shape[1] - 1)]
    return pages * batch.page_size + pos % batch.page_size, pos


def _key_span(batch: Any, i: int, length: int) -> torch.Tensor | slice:
    """Flat slots of sequence `i`'s keys 0..length-1: a slice (a view, no gather) when its pages are consecutive."""
    pages = batch.page_lists[i][: -(-length // batch.page_size)]
    if pages and pages[-1] - pages[0] == len(pages) - 1 and pages == list(range(pages[0], pages[-1] + 1)):
        return slice(pages[0] * batch.page_size, pages[0] * batch.page_size + length)
    return _key_slots(batch, [i], length)[0][0]


def _continues(bound: torch.Tensor, kv_len: int) -> bool:
    """Whether a chunk's key bounds are plain causal after the sequence's earlier keys: kv_len - n + 1, ..., kv_len."""
    n = bound.shape[0]
    return int(bound[0]) == kv_len - n + 1 and (n == 1 or bool((bound[1:] - bound[:-1] == 1).all()))


def _bounds(batch: Any, seqs: list[int], rows: torch.Tensor) -> torch.Tensor:
    """Exclusive key bound of each decoding row: its sequence length, or less under a block mask."""
    bound = torch.tensor([batch.kv_lens[i] for i in seqs], device=rows.device)
    return bound if batch.limits is None else torch.minimum(bound, batch.limits[rows])


#: Fewest rows per run, on average, for a block-masked chunk to run as one unmasked SDPA per run.
MIN_ROWS_PER_RUN = 16


def _block_runs(bound: torch.Tensor) -> list[tuple[int, int, int]] | None:
    """A chunk's rows as runs of equal key bound, `(first, end, bound)`, when a few runs cover them (a block mask).

    Each run then attends to keys `[0, bound)` without a mask: on CPU, SDPA with a mask costs ~10 % more per
    layer than without (pi0's prefix and its state token: one block of 555 rows, one of 1). None: use a mask.
    """
    n = bound.shape[0]
    cuts = (bound[1:] != bound[:-1]).nonzero().flatten().tolist()
    if (len(cuts) + 1) * MIN_ROWS_PER_RUN > n:
        return None
    edges = [0, *(c + 1 for c in cuts), n]
    bounds = bound[torch.tensor(edges[:-1], device=bound.device)].tolist()
    return list(zip(edges[:-1], edges[1:], bounds, strict=True))


def decode_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor | None,
                      scale: float) -> torch.Tensor:
    """One query token per row: q `[B, Hq, D]` over keys/values `[B, Hkv, L, D]` -> `[B, Hq, D]`.

    In fp32 two batched matmuls with the query heads of a KV head stacked (each key read once per KV
    head, not once per query head): on CPU ~20-30 % faster than SDPA's flash kernel for a 1-token
    query at 100-300 keys. On CPU, bf16/fp16 keys and values are widened to fp32 for the same matmuls
    (exact: every bf16 value is an fp32 value): SDPA's flash kernel takes ~6.7x as long for a bf16
    1-token query here (1,286 vs 192 us per layer, 8 rows x 300 keys, AVX512-BF16). Other devices keep
    SDPA for other dtypes (its softmax accumulates in fp32).
    """
    b, hq, d = q.shape
    hkv = keys.shape[1]
    if q.dtype != torch.float32:
        if q.device.type != "cpu":
            return F.scaled_dot_product_attention(q.unsqueeze(2), keys, vals, attn_mask=mask, scale=scale,
                                                  enable_gqa=hq != hkv).squeeze(2)
        return decode_attention(q.float(), keys.float(), vals.float(), mask, scale).to(q.dtype)
    scores = torch.matmul(q.view(b, hkv, hq // hkv, d), keys.transpose(-1, -2)).mul_(scale)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))  # (every row sees at least one key)
    return torch.matmul(scores.softmax(-1), vals).view(b, hq, d)


class TorchPagedContext:
    """`AttentionContext` for one step over the paged pool."""

    def __init__(self, batch: Any, kv: torch.Tensor, lanes: DecodeLanes | None = None,
                 pages: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        self.kv = kv
        # views built once, not per layer (a few tensor ops each, times every layer of every step)
        self.pages = pages if pages is not None else page_views(kv)
        self.slots = batch.slot_mapping
        self.num_tokens = batch.num_tokens
        self.gather_buf: torch.Tensor | None = None
        self.lanes = lanes
        starts = getattr(batch, "row_starts", None) or batch.q_start.tolist()
        device = batch.slot_mapping.device
        readonly = set(getattr(batch, "readonly", ()))
        self.write_rows = getattr(batch, "write_rows", None)
        decode = [i for i, n in enumerate(batch.q_lens) if n == 1 and i not in readonly]
        self.in_lanes = None
        self.kernel: lane_kernel.LaneCall | None = None
        self._windows: tuple[torch.Tensor, torch.Tensor] | None = None  # (built where torch ops attend: see `lane_windows`)
        self._storing: tuple | None = None  # the layout the lane kernel took at this step's first storing layer
        # a prompt step's kernel calls, as (the layout they were built for, the calls or None where the kernel does not
        # take them), built at its first layer
        self._prompts: tuple[tuple, prefill_kernel.PromptCalls | None] | None = None
        if decode and lanes is not None:
            got = lanes.assign(kv, [batch.seq_ids[i] for i in decode], [batch.page_lists[i] for i in decode],
                               [batch.kv_lens[i] for i in decode])
            self.in_lanes = self._lane_plan(batch, starts, [(i, g) for i, g in zip(decode, got, strict=True) if g is not None])
            if self.in_lanes is not None:
                self.kernel = lane_kernel.LaneCall.for_plan(self.in_lanes, lanes.kv)
            decode = [i for i, g in zip(decode, got, strict=True) if g is None]
        self.decode: tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None] | None = None
        if decode:
            # decodes gather whole pages (one contiguous block per page, much cheaper than per-slot rows)
            rows = torch.tensor([starts[i] for i in decode], device=device)
            table = batch.page_table if len(decode) == batch.num_seqs else batch.page_table[torch.tensor(decode, device=device)]
            width = table.shape[1] * batch.page_size
            bound = _bounds(batch, decode, rows)
            mask = None
            if width != int(bound.min()) or int(bound.max()) != width:
                mask = (torch.arange(width, device=device)[None, :] < bound[:, None])[:, None, None, :]
            self.decode = (rows, table.reshape(-1), width, mask)
        # longer chunks (prefills) run one sequence at a time: few per step, and no padding waste
        limits = batch.limits
        self.prefill: list[tuple[int, int, torch.Tensor | slice | None, torch.Tensor | None, bool, Any, int | None]] = []
        for i, n in enumerate(batch.q_lens):
            if n == 1 or i in readonly:
                continue
            start, kv_len = starts[i], batch.kv_lens[i]
            fresh = kv_len == n
            causal = limits is None or bool(
                (limits[start : start + n] == batch.positions[start : start + n] + 1).all()
            )
            slots = None if fresh else _key_span(batch, i, kv_len)
            mask = runs = None
            prefix = 0 if fresh and causal else None  # (row r sees keys [0, prefix + r]: the prefill kernel's case)
            if not (fresh and causal):
                bound = limits[start : start + n] if limits is not None else batch.positions[start : start + n] + 1
                if causal or int(bound.min()) < kv_len:  # else every row sees every key (a block at the end)
                    runs = None if causal else _block_runs(bound)
                    if runs is None:
                        mask = torch.arange(kv_len, device=device)[None, :] < bound[:, None]
                        if causal and _continues(bound, kv_len):  # a chunk after its sequence's cached keys
                            prefix = kv_len - n
            self.prefill.append((start, n, slots, mask, fresh and causal, runs, prefix))
        # a prompt step: every row is in a fresh causal chunk the prefill kernel may take, and the kernel stores each
        # chunk's keys and values in the pool as it reads them (two single-threaded torch ops a layer fewer)
        self.prompts_only = (self.in_lanes is None and self.decode is None and not readonly and self.write_rows is None
                             and all(fresh and prefix == 0 for _, _, _, _, fresh, _, prefix in self.prefill))
        # read-only sequences: frozen context keys (gathered) then their own keys, which are never stored
        self.readonly: list[tuple[int, int, torch.Tensor, torch.Tensor | None]] = []
        for i in sorted(readonly):
            start, n, ctx = starts[i], batch.q_lens[i], batch.context_slots[i]
            pos = torch.arange(ctx.shape[0] + n, device=device)
            bound = limits[start : start + n] if limits is not None else batch.positions[start : start + n] + 1
            every_key = int(bound.min()) >= pos.shape[0]  # a bidirectional block at the end: no mask needed
            self.readonly.append((start, n, ctx, None if every_key else pos[None, :] < bound[:, None]))

    def replay_layout(self) -> tuple[tuple, tuple[torch.Tensor, ...]] | None:
        """Where this step's attention is the lane kernel alone (every row in a lane, lanes 0..rows-1): the storage its
        calls point at, and the tensors it reads.

        A recorded step (see `mstar_kvcache.replay`) replays for steps of as many rows over the same storage, with these
        tensors (each row's lane, write position, bound and pool slot) copied into the recorded step's; a recording
        over other storage (the lanes grew) is stale. None: the step cannot replay.
        """
        plan = self.in_lanes
        if plan is None or not plan.whole or self.write_rows is not None or self.kernel is None:
            return None
        store = self.lanes.kv
        return (store.data_ptr(), tuple(store.shape), self.kv.data_ptr()), (self.kernel.index, self.slots)

    @property
    def lane_windows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's lane keys and values the step attends over through torch ops, `[layers, lanes, kv heads, width,
        dim]` views; built on first use (the kernel never needs them, and a replayed step builds nothing)."""
        if self._windows is None:
            count, width = self.in_lanes.count, self.in_lanes.width
            kv = self.lanes.kv[:, :, :count, :width].transpose(3, 4)
            self._windows = (kv[:, 0], kv[:, 1])
        return self._windows

    @staticmethod
    def _lane_plan(batch: Any, starts: list[int], picked: list[tuple[int, int]]) -> LanePlan | None:
        """The plan for the rows decoding in lanes (`picked`: sequence index, lane)."""
        if not picked:
            return None
        device = batch.slot_mapping.device
        seqs, lane_ids = [i for i, _ in picked], [g for _, g in picked]
        row_list = [starts[i] for i in seqs]
        kv_lens = batch.kv_lens
        # rows, lanes, write positions and (without limits) bounds in one tensor: what the lane kernel reads, and what
        # a replayed step copies (a decode step builds it; one tensor op, not four and a stack)
        plain = batch.limits is None
        index = torch.tensor([row_list, lane_ids, [kv_lens[i] - 1 for i in seqs], [kv_lens[i] for i in seqs] if plain
                              else [0] * len(seqs)], dtype=torch.int64, device=device)
        rows, lane_t, pos, row_bound = index.unbind()
        count = max(lane_ids) + 1
        # every row of the step decodes in a lane and the lanes in use are packed: the rows are a
        # permutation of lanes 0..count-1, so keys go in straight from k/v and only q is reordered
        in_order = row_list == list(range(count))
        whole = len(picked) == count == batch.num_tokens and in_order
        order = None  # row serving each lane, when that is not lane l -> row l
        if whole and lane_ids != list(range(count)):
            order = torch.empty(count, dtype=torch.long, device=device)
            order[lane_t] = rows
        if plain:  # (the usual decode step: the bounds are the lengths, known here)
            bounds = [1] * count  # lanes idle this step see one key
            for (i, lane) in picked:
                bounds[lane] = kv_lens[i]
            width = max(bounds)
            bound = torch.tensor(bounds, device=device) if min(bounds) != width else None
        else:
            row_bound.copy_(_bounds(batch, seqs, rows))
            bound = torch.ones(count, dtype=torch.long, device=device)
            bound[lane_t] = row_bound
            width = int(bound.max())
            bound = bound if int(bound.min()) != width else None
        mask = None
        if bound is not None:
            mask = (torch.arange(width, device=device)[None, :] < bound[:, None])[:, None, None, :]
        return LanePlan(rows, lane_t, pos, count, width, mask, whole, order, row_bound, index)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Write this step's keys/values into their pages, then attend each query to its sequence's keys."""
        hkv = k.shape[1]
        k_cache, v_cache = self.pages[layer]
        if self.in_lanes is not None and self.in_lanes.whole and self.write_rows is None:
            out = self._attend_lanes_storing(layer, q, k, v, scale, k_cache, v_cache)
            if out is not None:  # (a decode-only step: pool stores, lane stores and attention in one kernel call)
                return out
        if self.prompts_only:
            out = self._attend_prompts(q, k, v, scale, k_cache, v_cache)
            if out is not None:  # (a prompt step: every chunk's stores and attention through the kernel's first plans)
                return out
        stored = self.prompts_only and k_cache.dtype == k.dtype  # (each chunk's keys stored by the kernel, or below)
        if self.write_rows is None and not stored:
            k_cache.index_copy_(0, self.slots, k.to(k_cache.dtype))
            v_cache.index_copy_(0, self.slots, v.to(v_cache.dtype))
        elif self.write_rows is not None and self.slots.numel():
            k_cache.index_copy_(0, self.slots, k[self.write_rows].to(k_cache.dtype))
            v_cache.index_copy_(0, self.slots, v[self.write_rows].to(v_cache.dtype))
        gqa = q.shape[1] != hkv
        if self.in_lanes is not None and self.in_lanes.whole:
            return self._attend_lanes(layer, q, k, v, scale, gqa, None)
        out = torch.empty_like(q)
        if self.in_lanes is not None:
            self._attend_lanes(layer, q, k, v, scale, gqa, out)
        if self.decode is not None:
            self._attend_gathered(layer, q, scale, gqa, out)
        for start, n, slots, mask, is_causal, runs, prefix in self.prefill:
            if slots is None:
                keys, vals = k[start : start + n], v[start : start + n]
            else:
                keys, vals = k_cache[slots], v_cache[slots]
            store = (k_cache, v_cache, self.slots[start : start + n]) if stored else None
            if prefix is not None and prefill_kernel.attend(q[start : start + n], keys, vals, out[start : start + n],
                                                            prefix, scale, store=store):
                continue
            if stored:  # (the kernel did not take the chunk: its keys and values go in here)
                k_cache.index_copy_(0, store[2], keys)
                v_cache.index_copy_(0, store[2], vals)
            qh = q[start : start + n].transpose(0, 1)
            keys, vals = keys.transpose(0, 1), vals.transpose(0, 1)
            # 4-D (a batch of one): CPU's flash kernel takes only 4-D inputs; 3-D falls back to the math path (~4x slower)
            for lo, hi, bound in runs or ((0, n, None),):  # a block mask: each run of rows sees keys [0, bound)
                res = F.scaled_dot_product_attention(
                    qh[:, lo:hi].to(keys.dtype)[None], keys[None, :, :bound], vals[None, :, :bound], attn_mask=mask,
                    is_causal=is_causal, scale=scale, enable_gqa=gqa,
                )[0]
                out[start + lo : start + hi] = res.transpose(0, 1).to(q.dtype)
        for start, n, ctx, mask in self.readonly:
            keys = torch.cat((k_cache[ctx], k[start : start + n].to(k_cache.dtype))).transpose(0, 1)
            vals = torch.cat((v_cache[ctx], v[start : start + n].to(v_cache.dtype))).transpose(0, 1)
            res = F.scaled_dot_product_attention(
                q[start : start + n].transpose(0, 1).to(keys.dtype)[None], keys[None], vals[None], attn_mask=mask,
                scale=scale, enable_gqa=gqa,
            )[0]
            out[start : start + n] = res.transpose(0, 1).to(q.dtype)
        return out

    def _attend_prompts(self, q, k, v, scale, k_cache, v_cache):
        """Every row is in a fresh causal chunk: the kernel's calls built at the first layer (then only the layout
        checked and pointers passed, a few microseconds a layer); None: the kernel does not take them."""
        layout = prefill_kernel.PromptCalls.layout_of(q, k, v, k_cache, scale)
        seen = self._prompts
        if seen is None or seen[0] != layout:
            calls = prefill_kernel.PromptCalls.build(q, k, v, k_cache, v_cache, self.slots,
                                                     [(start, n) for start, n, *_ in self.prefill], scale)
            seen = self._prompts = (layout, calls)
        return None if seen[1] is None else seen[1](q, k, v, k_cache, v_cache)

    def _attend_lanes_storing(self, layer, q, k, v, scale, k_cache, v_cache):
        """Every row decodes in a lane: the kernel stores its new key and value in the pool and its lane and attends; None: it cannot."""
        seen = self._storing
        # every layer of a step after the first: the layout the first checked, so the kernel takes pointers (the checks
        # and per-layer views cost about as much as a one-row layer's attention itself)
        if seen is not None and seen[0] == (q.shape, q.stride(), k.stride(), v.stride(), scale) and q.dtype is seen[1]:
            out = q.new_empty(q.shape)
            k_lanes, v_lanes, layer_bytes = seen[2]
            self.kernel.call(q.data_ptr(), k.data_ptr(), v.data_ptr(), k_lanes + layer * layer_bytes,
                             v_lanes + layer * layer_bytes, k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr())
            return out
        store_k, store_v = self.lanes.kv[:, 0], self.lanes.kv[:, 1]
        if self.kernel is None or k_cache.dtype != k.dtype or k_cache.stride(-1) != 1 or not self.kernel.fits(q, k, v, store_k[layer]):
            return None
        out = q.new_empty(q.shape)
        self.kernel(q, k, v, store_k[layer], store_v[layer], out, scale, (k_cache, v_cache, self.slots))
        layer_bytes = store_k.stride(0) * store_k.element_size()
        self._storing = ((q.shape, q.stride(), k.stride(), v.stride(), scale), q.dtype,
                         (store_k.data_ptr(), store_v.data_ptr(), layer_bytes))
        return out

    def _attend_lanes(self, layer, q, k, v, scale, gqa, out):
        """Append each lane row's new key/value to its lane, then attend over the lanes (the kernel, else torch ops)."""
        rows, lane_t, pos, count, width, mask, whole, order, *_ = self.in_lanes
        store_k, store_v = self.lanes.kv[layer, 0], self.lanes.kv[layer, 1]
        if self.kernel is not None and self.kernel.fits(q, k, v, store_k):
            if out is None:
                out = q.new_empty(q.shape)
            self.kernel(q, k, v, store_k, store_v, out, scale)
            return out
        if whole:
            store_k.index_put_((lane_t, pos), k.to(store_k.dtype))
            store_v.index_put_((lane_t, pos), v.to(store_v.dtype))
            ql = q if order is None else q.index_select(0, order)
        else:
            store_k.index_put_((lane_t, pos), k[rows].to(store_k.dtype))
            store_v.index_put_((lane_t, pos), v[rows].to(store_v.dtype))
            ql = q.new_zeros(count, q.shape[1], q.shape[2])
            ql[lane_t] = q[rows]
        window_k, window_v = self.lane_windows
        keys = window_k[layer]  # [count, kv heads, width, dim], rows contiguous
        vals = window_v[layer]
        res = decode_attention(ql.to(keys.dtype), keys, vals, mask, scale)
        if whole:
            return (res if order is None else res.index_select(0, lane_t)).to(q.dtype)
        out[rows] = res[lane_t].to(q.dtype)
        return out

    def _attend_gathered(self, layer, q, scale, gqa, out):
        """Decoding rows without a lane: gather their whole pages (keys and values in one index_select)."""
        rows, pages, width, mask = self.decode
        hkv, dim = self.kv.shape[4], self.kv.shape[5]
        qd = q[rows]
        g = qd.shape[0]
        layer_kv = self.kv[layer].view(2, self.kv.shape[2], -1)
        if self.gather_buf is None:  # one buffer reused by every layer: no per-layer allocation
            self.gather_buf = layer_kv.new_empty(2, pages.shape[0], layer_kv.shape[2])
        both = torch.index_select(layer_kv, 1, pages, out=self.gather_buf).view(2, g, width, hkv, dim)
        keys, vals = both[0].transpose(1, 2), both[1].transpose(1, 2)
        res = decode_attention(qd.to(keys.dtype), keys, vals, mask, scale)
        out[rows] = res.to(q.dtype)
