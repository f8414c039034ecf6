"""A frame cache on `mstar_kvcache`'s paged KV pool: one page per frame, per-sequence page tables, forks by refcount.

Pages hold exactly one time step's tokens, so a fork's new frames always land on fresh pages and shared
prefix pages are never written: forking S CEM samples from the context copies no page at all.
"""

from __future__ import annotations

import torch
from mstar_kvcache.pool import PagePool


def frame_pool(predictor, num_pages: int, dtype: torch.dtype | None = None, device=None) -> PagePool:
    """A pool whose pages fit one AC time step (`[a, s, patches]`) of `predictor`."""
    cfg = predictor.cfg
    p = predictor.predictor_embed.weight
    return PagePool(num_pages, cfg.tokens_per_frame + 2, cfg.depth, cfg.num_heads, cfg.predictor_embed_dim // cfg.num_heads,
                    dtype or p.dtype, device or p.device)


class PagedFrameCache:
    """B sequences' frames as page tables into a shared `PagePool`; call `free()` when done."""

    def __init__(self, pool: PagePool, batch: int, tables: list[list[int]] | None = None):
        self.pool = pool
        self.batch = batch
        self.tables = tables if tables is not None else [[] for _ in range(batch)]
        self.num_frames = len(self.tables[0]) if self.tables else 0

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, tokens, d = k.shape
        tpf = self.pool.page_size
        n = tokens // tpf
        if layer == 0:  # pages serve every layer: allocate once per new frame
            for table in self.tables:
                table.extend(self.pool.allocate() for _ in range(n))
        new = torch.tensor([t[self.num_frames + i] for t in self.tables for i in range(n)], device=k.device)
        kv = self.pool.kv[layer]
        kv[0, new] = k.transpose(1, 2).reshape(b * n, tpf, h, d)
        kv[1, new] = v.transpose(1, 2).reshape(b * n, tpf, h, d)
        frames = self.num_frames + n
        first = self.tables[0][0]
        if b == 1 and self.tables[0] == list(range(first, first + frames)):
            # pages handed out in order (the common single-sequence case): a view, no gather
            keys, values = kv[0, first : first + frames], kv[1, first : first + frames]
        else:
            pages = torch.tensor([t[:frames] for t in self.tables], device=k.device)  # [B, F]
            keys, values = kv[0, pages], kv[1, pages]
        return keys.reshape(b, -1, h, d).transpose(1, 2), values.reshape(b, -1, h, d).transpose(1, 2)

    @classmethod
    def batch_of(cls, caches: list[PagedFrameCache]) -> PagedFrameCache:
        """One batch over several single-sequence caches of equal length (e.g. different requests' rollouts).

        The batch shares their page tables, so new pages land in each member; `commit` advances them all.
        """
        if any(c.batch != 1 or c.num_frames != caches[0].num_frames or c.pool is not caches[0].pool for c in caches):
            raise ValueError("batch_of needs single-sequence caches of one pool with the same number of frames")
        view = cls(caches[0].pool, len(caches), [c.tables[0] for c in caches])
        view.members = caches
        return view

    def commit(self, frames: int) -> None:
        self.num_frames += frames
        for member in getattr(self, "members", ()):
            member.num_frames += frames

    def fork(self, n: int) -> PagedFrameCache:
        """n sequences sharing this (single-sequence) cache's pages; nothing is copied."""
        if self.batch != 1:
            raise ValueError("fork a single-sequence cache")
        for page in self.tables[0]:
            for _ in range(n):
                self.pool.incref(page)
        return PagedFrameCache(self.pool, n, [list(self.tables[0]) for _ in range(n)])

    def copy(self, n: int) -> PagedFrameCache:
        """n sequences, each with its own copies of this cache's pages (the reference for fork)."""
        if self.batch != 1:
            raise ValueError("copy a single-sequence cache")
        return PagedFrameCache(self.pool, n, [[self.pool.copy(p) for p in self.tables[0]] for _ in range(n)])

    def free(self) -> None:
        """Drop this cache's page references."""
        for table in self.tables:
            for page in table:
                self.pool.decref(page)
            table.clear()
        self.num_frames = 0

    def nbytes(self) -> int:
        """Bytes of pages this cache references (shared pages counted once per pool, not here)."""
        per_page = PagePool.bytes_per_page(self.pool.page_size, *self.pool.kv.shape[:1], *self.pool.kv.shape[4:],
                                           self.pool.kv.dtype)
        return per_page * len({p for t in self.tables for p in t})
