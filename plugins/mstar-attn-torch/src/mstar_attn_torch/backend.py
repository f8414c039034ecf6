"""Paged attention with `scaled_dot_product_attention`: keys gathered from pages by precomputed slot indices.

The gather indices and masks depend only on the step's layout, so they are built once per step
(in `TorchPagedContext.__init__`) and every layer reuses them; a layer costs one scatter of its
new keys/values into the pages, one gather and one SDPA call per group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class TorchPagedAttention:
    """The `torch` backend: works on any device torch runs on."""

    name = "torch"

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    @staticmethod
    def available(device: torch.device | str) -> bool:
        """Whether the backend can run on `device` (always)."""
        return True

    def begin(self, batch: Any, kv: torch.Tensor) -> TorchPagedContext:
        """Attention context for one step; `batch` is a `mstar_kvcache.PagedBatch`, `kv` the pool tensor."""
        return TorchPagedContext(batch, kv)


def _key_slots(batch: Any, seqs: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat cache slots `[len(seqs), length]` of each sequence's keys 0..length-1, and the key positions."""
    device = batch.page_table.device
    pos = torch.arange(length, device=device)
    table = batch.page_table[torch.tensor(seqs, device=device)] if len(seqs) != batch.num_seqs else batch.page_table
    pages = table[:, (pos // batch.page_size).clamp(max=table.shape[1] - 1)]
    return pages * batch.page_size + pos % batch.page_size, pos


class TorchPagedContext:
    """`AttentionContext` for one step over the paged pool."""

    def __init__(self, batch: Any, kv: torch.Tensor):
        self.kv = kv
        self.slots = batch.slot_mapping
        self.gather_buf: torch.Tensor | None = None
        starts = batch.q_start.tolist()
        device = batch.slot_mapping.device
        limits = batch.limits
        decode = [i for i, n in enumerate(batch.q_lens) if n == 1]
        self.decode: tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None] | None = None
        if decode:
            # decodes gather whole pages (one contiguous block per page, much cheaper than per-slot rows)
            rows = torch.tensor([starts[i] for i in decode], device=device)
            table = batch.page_table if len(decode) == batch.num_seqs else batch.page_table[torch.tensor(decode, device=device)]
            width = table.shape[1] * batch.page_size
            bound = torch.tensor([batch.kv_lens[i] for i in decode], device=device)
            if limits is not None:
                bound = torch.minimum(bound, limits[rows])
            mask = None
            if width != int(bound.min()) or int(bound.max()) != width:
                mask = (torch.arange(width, device=device)[None, :] < bound[:, None])[:, None, None, :]
            self.decode = (rows, table.reshape(-1), width, mask)
        # longer chunks (prefills) run one sequence at a time: few per step, and no padding waste
        self.prefill: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]] = []
        for i, n in enumerate(batch.q_lens):
            if n == 1:
                continue
            start, kv_len = starts[i], batch.kv_lens[i]
            fresh = kv_len == n
            causal = limits is None or bool(
                (limits[start : start + n] == batch.positions[start : start + n] + 1).all()
            )
            slots = None if fresh else _key_slots(batch, [i], kv_len)[0][0]
            mask = None
            if not (fresh and causal):
                pos = torch.arange(kv_len, device=device)
                bound = limits[start : start + n] if limits is not None else batch.positions[start : start + n] + 1
                mask = pos[None, :] < bound[:, None]
            self.prefill.append((start, n, slots, mask))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Write this step's keys/values into their pages, then attend each query to its sequence's keys."""
        hkv, dim = k.shape[1], k.shape[2]
        k_cache = self.kv[layer, 0].view(-1, hkv, dim)
        v_cache = self.kv[layer, 1].view(-1, hkv, dim)
        k_cache.index_copy_(0, self.slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, self.slots, v.to(v_cache.dtype))
        gqa = q.shape[1] != hkv
        if self.decode is not None and not self.prefill and self.decode[0].shape[0] == q.shape[0]:
            out = None  # every row is a decode: write straight into the result
        else:
            out = torch.empty_like(q)
        if self.decode is not None:
            rows, pages, width, mask = self.decode
            qd = q if out is None else q[rows]
            g = qd.shape[0]
            # keys and values of every needed page in one gather: [2, pages, page_size * heads * dim]
            layer_kv = self.kv[layer].view(2, self.kv.shape[2], -1)
            if self.gather_buf is None:  # one buffer reused by every layer: no per-layer allocation
                self.gather_buf = layer_kv.new_empty(2, pages.shape[0], layer_kv.shape[2])
            both = torch.index_select(layer_kv, 1, pages, out=self.gather_buf).view(2, g, width, hkv, dim)
            keys, vals = both[0].transpose(1, 2), both[1].transpose(1, 2)
            res = F.scaled_dot_product_attention(
                qd.unsqueeze(2).to(keys.dtype), keys, vals, attn_mask=mask, scale=scale, enable_gqa=gqa
            ).squeeze(2)
            if out is None:
                return res.to(q.dtype)
            out[rows] = res.to(q.dtype)
        for start, n, slots, mask in self.prefill:
            qh = q[start : start + n].transpose(0, 1)
            if slots is None:
                keys, vals = k[start : start + n].transpose(0, 1), v[start : start + n].transpose(0, 1)
            else:
                keys, vals = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)
            res = F.scaled_dot_product_attention(
                qh.to(keys.dtype), keys, vals, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
            )
            out[start : start + n] = res.transpose(0, 1).to(q.dtype)
        return out
