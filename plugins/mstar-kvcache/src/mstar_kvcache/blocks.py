"""Page tables: reserve pages for a sequence's next tokens (copy-on-write), prefix-cache matching, fork, free."""

from __future__ import annotations

import attrs

from mstar_kvcache.pool import PagePool
from mstar_kvcache.sequence import Sequence


def chain_hash(previous: int, tokens: list[int]) -> int:
    """Key of a full page: its tokens plus the key of the page before it (so equal keys mean equal prefixes)."""
    return hash((previous, *tokens))


class BlockManager:
    """Moves pages between the pool and sequences; knows nothing about models or scheduling."""

    def __init__(self, pool: PagePool, prefix_caching: bool = True):
        self.pool = pool
        self.page_size = pool.page_size
        self.prefix_caching = prefix_caching

    def pages_needed(self, seq: Sequence, n: int) -> int:
        """Pages `reserve(seq, n)` would take from the pool (new pages plus a copy of a shared partial page)."""
        end = seq.num_computed + n
        need = -(-end // self.page_size) - len(seq.pages)
        offset = seq.num_computed % self.page_size
        if n and offset and self.pool.refcount[seq.pages[-1]] > 1:
            need += 1
        return need

    def total_pages(self, seq: Sequence) -> int:
        """Pages the whole sequence needs once every appended token is cached."""
        return -(-len(seq.tokens) // self.page_size)

    def reserve(self, seq: Sequence, n: int) -> bool:
        """Give `seq` room to write its next `n` tokens; False (and no change) if the pool is short."""
        if self.pages_needed(seq, n) > self.pool.num_available:
            return False
        if n and seq.num_computed % self.page_size and self.pool.refcount[seq.pages[-1]] > 1:
            shared = seq.pages[-1]
            seq.pages[-1] = self.pool.copy(shared)  # another branch still reads the shared page
            self.pool.decref(shared)
        end = seq.num_computed + n
        while len(seq.pages) * self.page_size < end:
            seq.pages.append(self.pool.allocate())
        return True

    def match_prefix(self, seq: Sequence) -> int:
        """Reuse cached pages for a sequence that holds none; returns the number of tokens reused.

        At least one token is always left to compute, so the step still produces logits.
        """
        if not (self.prefix_caching and seq.cacheable) or seq.pages or seq.num_computed:
            return 0
        previous = 0
        for i in range((len(seq.tokens) - 1) // self.page_size):
            key = chain_hash(previous, seq.tokens[i * self.page_size : (i + 1) * self.page_size])
            page = self.pool.lookup(key)
            if page is None:
                break
            self.pool.incref(page)
            self.pool.hits += 1
            seq.pages.append(page)
            seq.hashes.append(key)
            previous = key
        seq.num_computed = len(seq.pages) * self.page_size
        return seq.num_computed

    def commit(self, seq: Sequence) -> None:
        """Key the pages that became full so later requests can reuse them."""
        full = seq.num_computed // self.page_size
        previous = seq.hashes[-1] if seq.hashes else 0
        for i in range(len(seq.hashes), full):
            previous = chain_hash(previous, seq.tokens[i * self.page_size : (i + 1) * self.page_size])
            seq.hashes.append(previous)
            if self.prefix_caching and seq.cacheable:
                self.pool.register(seq.pages[i], previous)

    def truncate(self, seq: Sequence, length: int) -> None:
        """Drop tokens from `length` on, releasing pages no longer needed."""
        del seq.tokens[length:]
        seq.num_computed = min(seq.num_computed, length)
        keep = -(-seq.num_computed // self.page_size)
        for page in seq.pages[keep:]:
            self.pool.decref(page)
        del seq.pages[keep:]
        del seq.hashes[seq.num_computed // self.page_size :]
        if seq.limits is not None:
            del seq.limits[length:]
        seq.embeds = [(start, rows) for start, rows in seq.embeds if start < length]

    def free(self, seq: Sequence) -> None:
        """Release every page (tokens stay, so a preempted sequence can be recomputed)."""
        for page in seq.pages:
            self.pool.decref(page)
        seq.pages.clear()
        seq.hashes.clear()
        seq.num_computed = 0

    def fork(self, src: Sequence, label: str) -> Sequence:
        """A new label sharing every page of `src` (no copies until one of them writes into a shared page)."""
        for page in src.pages:
            self.pool.incref(page)
        return attrs.evolve(
            src,
            label=label,
            tokens=list(src.tokens),
            pages=list(src.pages),
            hashes=list(src.hashes),
            limits=None if src.limits is None else list(src.limits),
            embeds=list(src.embeds),
            generated=list(src.generated),
            generator=None,  # never shared: the engine gives the fork its own (sampling is not this file's job)
            pending=None,
        )
