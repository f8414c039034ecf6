"""Paged attention with FlashInfer's batch prefill kernel over the pool's NHD pages.

One `BatchPrefillWithPagedKVCacheWrapper` handles decodes (one query row) and prefill chunks
alike. It is planned once per step, at the first layer's call (the head counts come from q/k),
and reused by every layer. Non-causal masks (bidirectional blocks, frame-causal) become
FlashInfer's flattened custom mask.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

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


def _custom_mask(batch: Any) -> torch.Tensor:
    """Flattened `[sum(q_len * kv_len)]` bool mask: query t sees key positions below `limits[t]`."""
    parts = []
    starts = batch.q_start.tolist()
    for i, (n, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens, strict=True)):
        bound = batch.limits[starts[i] : starts[i] + n]
        pos = torch.arange(kv_len, device=bound.device)
        parts.append((pos[None, :] < bound[:, None]).reshape(-1))
    return torch.cat(parts)


class FlashInferPagedContext:
    """`AttentionContext` for one step, backed by a planned FlashInfer wrapper."""

    def __init__(self, wrapper: Any, batch: Any, kv: torch.Tensor):
        self.wrapper, self.batch, self.kv = wrapper, batch, kv
        self.planned = False

    def _plan(self, q: torch.Tensor, k: torch.Tensor, scale: float) -> None:
        b, dev = self.batch, self.kv.device
        pages_per_seq = [len(p) for p in b.page_lists]
        indptr = torch.zeros(len(pages_per_seq) + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(torch.tensor(pages_per_seq, dtype=torch.int32), 0)
        indices = torch.tensor([p for pages in b.page_lists for p in pages], dtype=torch.int32)
        last = torch.tensor([(n - 1) % b.page_size + 1 for n in b.kv_lens], dtype=torch.int32)
        mask = None if b.limits is None else _custom_mask(b).to(dev)
        self.wrapper.plan(
            b.q_start.to(dev, torch.int32),
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
        self.kv[layer, 0].view(-1, hkv, dim).index_copy_(0, self.batch.slot_mapping, k.to(self.kv.dtype))
        self.kv[layer, 1].view(-1, hkv, dim).index_copy_(0, self.batch.slot_mapping, v.to(self.kv.dtype))
        if not self.planned:
            self._plan(q, k, scale)
        return self.wrapper.run(q.to(self.kv.dtype), (self.kv[layer, 0], self.kv[layer, 1])).to(q.dtype)
