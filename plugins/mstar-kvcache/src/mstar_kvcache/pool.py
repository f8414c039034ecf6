"""The paged KV pool: preallocated pages, reference counts, a prefix-cache index with LRU eviction."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable

import torch


class OutOfPages(RuntimeError):
    """No free or evictable page is left (the scheduler preempts or waits; users never see this)."""


class PagePool:
    """Fixed-size KV pages allocated once, as one tensor `[layers, 2 (k/v), pages, page_size, kv_heads, head_dim]`.

    A page is *used* while some sequence references it. A full page may also be *cached* under
    the chained digest of its content; when its last reference goes it stays cached but evictable
    (least recently released first), so a later request with the same prefix reuses it.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages} and {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        # zeros, not empty: zeroing writes every page now, so the kernel maps them at load instead of a request's
        # first write faulting them in one 4 KiB page at a time (measured here: 64 ms for an 80 MiB pool, once)
        self.kv = torch.zeros(num_layers, 2, num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.refcount = [0] * num_pages
        # lowest page first: one sequence's pages tend to be consecutive, which attention can read as a view
        self._free: list[int] = list(range(num_pages))  # a heap
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self.copies = 0  # copy-on-write page copies, for stats and tests
        self.hits = 0  # pages reused from the prefix cache
        self.partial_hits = 0  # partly written pages reused (a finished sequence's last page: BlockManager.keep_partial)
        #: Called with `(page, digest)` as a cached page is evicted, before it is reused (a host tier's spill).
        self.spill: Callable[[int, bytes], None] | None = None

    @staticmethod
    def bytes_per_page(page_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Memory one page takes across all layers (keys and values)."""
        return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def num_available(self) -> int:
        """Pages that can be handed out now (free, or cached but unreferenced)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Pages referenced by at least one sequence."""
        return self.num_pages - self.num_available

    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    def allocate(self) -> int:
        """Take a page (never-cached first, then the least recently released cached one)."""
        if self._free:
            page = heapq.heappop(self._free)
        elif self._evictable:
            page, _ = self._evictable.popitem(last=False)
            key = self._hash_of.pop(page)
            del self._by_hash[key]
            if self.spill is not None:
                self.spill(page, key)
        else:
            raise OutOfPages("KV pool exhausted")
        self.refcount[page] = 1
        return page

    def incref(self, page: int) -> None:
        if self.refcount[page] == 0:
            self._evictable.pop(page)  # only cached pages can be revived from zero references
        self.refcount[page] += 1

    def decref(self, page: int) -> None:
        count = self.refcount[page] - 1
        if count < 0:
            raise AssertionError(f"page {page} released more often than referenced")
        self.refcount[page] = count
        if count == 0:
            if page in self._hash_of:
                self._evictable[page] = None
            else:
                heapq.heappush(self._free, page)

    def lookup(self, key: bytes) -> int | None:
        """The cached page holding the tokens hashed to `key`, if any."""
        return self._by_hash.get(key)

    def register(self, page: int, key: bytes) -> None:
        """Index a page under its chained hash (a page already cached under it wins). A page keyed as a partial page
        (`BlockManager.keep_partial`) that has since been filled takes its full key instead."""
        if key in self._by_hash:
            return
        if page in self._hash_of:
            self.unregister(page)
        self._by_hash[key] = page
        self._hash_of[page] = key

    def unregister(self, page: int) -> None:
        """Drop a page from the prefix-cache index (its content is about to change)."""
        key = self._hash_of.pop(page, None)
        if key is not None:
            del self._by_hash[key]
            if self.refcount[page] == 0 and page in self._evictable:  # (not expected: callers hold the page)
                del self._evictable[page]
                heapq.heappush(self._free, page)

    def copy(self, src: int) -> int:
        """Copy-on-write: a new page with `src`'s keys and values in every layer."""
        dst = self.allocate()
        self.kv[:, :, dst] = self.kv[:, :, src]
        self.copies += 1
        return dst

    def read_rows(self, pages: list[int], rows: int) -> torch.Tensor:
        """A copy of the first `rows` token rows of `pages`: `[layers, 2, rows, kv_heads, head_dim]`."""
        index = torch.tensor(pages, dtype=torch.long, device=self.kv.device)
        return self.kv.index_select(2, index).flatten(2, 3)[:, :, :rows].clone()

    def write_rows(self, pages: list[int], kv: torch.Tensor) -> None:
        """Store `kv` (`[layers, 2, rows, kv_heads, head_dim]`) as the first token rows of `pages`; the rest are zeros."""
        layers, _, _, page_size, heads, dim = self.kv.shape
        rows = kv.shape[2]
        if pages and pages == list(range(pages[0], pages[0] + len(pages))):
            # consecutive pages (a fresh label's, usually): one copy into their slots, zeros after the rows (a Whisper
            # label's 37 MB went through a zeroed staging copy and an index_copy_ before: ~20 ms a request)
            slots = self.kv[:, :, pages[0] : pages[0] + len(pages)].flatten(2, 3)
            slots[:, :, :rows] = kv
            slots[:, :, rows:].zero_()
            return
        filled = self.kv.new_zeros(layers, 2, len(pages) * page_size, heads, dim)
        filled[:, :, : kv.shape[2]] = kv
        index = torch.tensor(pages, dtype=torch.long, device=self.kv.device)
        self.kv.index_copy_(2, index, filled.unflatten(2, (len(pages), page_size)))

    def empty_rows(self, rows: int) -> torch.Tensor:
        """An uninitialised `[layers, 2, rows, kv_heads, head_dim]` in the pool's dtype and device."""
        layers, _, _, _, heads, dim = self.kv.shape
        return self.kv.new_empty(layers, 2, rows, heads, dim)

    def clear_cache(self) -> None:
        """Forget every cached page (used ones stay allocated)."""
        for page in list(self._evictable):
            heapq.heappush(self._free, page)
        self._evictable.clear()
        self._by_hash.clear()
        self._hash_of.clear()
