"""Paged attention with FlashInfer's batch prefill kernel over the pool's NHD pages.

One `BatchPrefillWithPagedKVCacheWrapper` handles decodes (one query row) and prefill chunks
alike. It is planned once per step, at the first layer's call (the head counts come from q/k),
and reused by every layer. Non-causal masks (bidirectional blocks, frame-causal) become
FlashInfer's flattened custom mask.

Read-only sequences of the step (`batch.readonly`) write nothing: the wrapper is planned over the
writing sequences only, and each read-only one attends to its frozen context slots plus its own
keys, held only for this step (gathered and run with `scaled_dot_product_attention`).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferPagedAttention:
    """The `flashinfer` backend: CUDA only."""

    name = "flashinfer"

    def __init__(self, device: torch.device | str = "cuda"):
        import flashinfer

        self.device = torch.device(device)
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD")

    @staticmethod
    def available(device: torch.device | str) -> bool:
        """CUDA device and an importable `flashinfer`."""
        return torch.device(device).type == "cuda" and importlib.util.find_spec("flashinfer") is not None

    def begin(self, batch: Any, kv: torch.Tensor) -> FlashInferPagedContext:
        """Attention context for one step; `batch` is a `mstar_kvcache.PagedBatch`, `kv` the pool tensor."""
        return FlashInferPagedContext(self.wrapper, batch, kv)


def _custom_mask(batch: Any, seqs: list[int]) -> torch.Tensor:
    """Flattened `[sum(q_len * kv_len)]` bool mask over `seqs`: query t sees key positions below `limits[t]`."""
    parts = []
    starts = batch.q_start.tolist()
    for i in seqs:
        n, kv_len = batch.q_lens[i], batch.kv_lens[i]
        bound = batch.limits[starts[i] : starts[i] + n]
        pos = torch.arange(kv_len, device=bound.device)
        parts.append((pos[None, :] < bound[:, None]).reshape(-1))
    return torch.cat(parts)


class FlashInferPagedContext:
    """`AttentionContext` for one step, backed by a planned FlashInfer wrapper."""

    def __init__(self, wrapper: Any, batch: Any, kv: torch.Tensor):
        self.wrapper, self.batch, self.kv = wrapper, batch, kv
        self.planned = False
        readonly = set(getattr(batch, "readonly", ()))
        self.writers = [i for i in range(batch.num_seqs) if i not in readonly]
        self.write_rows = getattr(batch, "write_rows", None)
        starts = batch.q_start.tolist()
        self.readers = []
        for i in sorted(readonly):
            start, n, ctx = starts[i], batch.q_lens[i], batch.context_slots[i]
            pos = torch.arange(ctx.shape[0] + n, device=ctx.device)
            bound = (batch.limits[start : start + n] if batch.limits is not None
                     else batch.positions[start : start + n] + 1)
            self.readers.append((start, n, ctx, pos[None, :] < bound[:, None]))

    def _plan(self, q: torch.Tensor, k: torch.Tensor, scale: float) -> None:
        b, dev = self.batch, self.kv.device
        pages_per_seq = [len(b.page_lists[i]) for i in self.writers]
        indptr = torch.zeros(len(pages_per_seq) + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(torch.tensor(pages_per_seq, dtype=torch.int32), 0)
        indices = torch.tensor([p for i in self.writers for p in b.page_lists[i]], dtype=torch.int32)
        last = torch.tensor([(b.kv_lens[i] - 1) % b.page_size + 1 for i in self.writers], dtype=torch.int32)
        mask = None if b.limits is None else _custom_mask(b, self.writers).to(dev)
        q_lens = torch.tensor([b.q_lens[i] for i in self.writers], dtype=torch.int32)
        qo_indptr = torch.zeros(len(self.writers) + 1, dtype=torch.int32)
        qo_indptr[1:] = torch.cumsum(q_lens, 0)
        self.wrapper.plan(
            qo_indptr.to(dev),
            indptr.to(dev),
            indices.to(dev),
            last.to(dev),
            q.shape[1],
            k.shape[1],
            q.shape[2],
            b.page_size,
            custom_mask=mask,
            causal=mask is None,
            sm_scale=scale,
            q_data_type=q.dtype,
            kv_data_type=self.kv.dtype,
        )
        self.planned = True

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Write this step's keys/values into their pages, then run the planned kernel on this layer's pages."""
        hkv, dim = k.shape[1], k.shape[2]
        k_cache, v_cache = self.kv[layer, 0].view(-1, hkv, dim), self.kv[layer, 1].view(-1, hkv, dim)
        rows = self.write_rows
        if self.batch.slot_mapping.numel():
            k_cache.index_copy_(0, self.batch.slot_mapping, (k if rows is None else k[rows]).to(self.kv.dtype))
            v_cache.index_copy_(0, self.batch.slot_mapping, (v if rows is None else v[rows]).to(self.kv.dtype))
        if not self.readers:
            if not self.planned:
                self._plan(q, k, scale)
            return self.wrapper.run(q.to(self.kv.dtype), (self.kv[layer, 0], self.kv[layer, 1])).to(q.dtype)
        out = torch.empty_like(q)
        if self.writers:
            if not self.planned:
                self._plan(q, k, scale)
            out[rows] = self.wrapper.run(q[rows].to(self.kv.dtype), (self.kv[layer, 0], self.kv[layer, 1])).to(q.dtype)
        for start, n, ctx, mask in self.readers:
            keys = torch.cat((k_cache[ctx], k[start : start + n].to(k_cache.dtype))).transpose(0, 1)
            vals = torch.cat((v_cache[ctx], v[start : start + n].to(v_cache.dtype))).transpose(0, 1)
            res = F.scaled_dot_product_attention(q[start : start + n].transpose(0, 1).to(keys.dtype), keys, vals,
                                                 attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != hkv)
            out[start : start + n] = res.transpose(0, 1).to(q.dtype)
        return out
