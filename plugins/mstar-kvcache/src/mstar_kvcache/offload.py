"""The host KV tier (setting `kv_offload`): preempted sequences' pages, and evicted prefix pages, kept in host memory.

Without it, a sequence the scheduler preempts when pages run out loses its pages and is recomputed
from its first token when it runs again. With it, `BlockManager.preempt` first copies the sequence's
pages (every layer, keys and values) to host pages; when the sequence is admitted again it takes
device pages (`plan_restore`, from `match_prefix`), the scheduler reserves them like any others, and
once the step is planned `load` copies the keys and values back, so the sequence continues where it
stopped. A restore that is not admitted after all (the pool is short) keeps its host copy for the next
step. Leading full pages still cached on the device (same digest) are referenced, not copied.

With `spill_prefixes`, a prefix-cache page the pool evicts is copied to a host page under its digest,
and a later prefix match that misses on the device brings it back (`fetch`) instead of recomputing it.
A full page inside a preempted sequence's copy is on the host already: it is not spilled again, and it
serves prefix hits the same way (the copy keeps it).

Host pages have the pool's layout, `[layers, 2, host_pages, page_size, kv_heads, head_dim]` (pinned on
CUDA). A preempted sequence's copy is never evicted; spilled prefix pages are a cache, dropped least
recently spilled first, also to make room for a preempted sequence. A preemption that finds the host
full (or is below `min_tokens`, or loses under rule `auto`) recomputes, as without the tier.

Rule `auto` offloads where 2 x pages x (seconds per page copy) < computed tokens x (seconds per
recomputed token): the copy cost is measured (one page out and back at start, then every copy this tier
makes, averaged); the token cost is the slope of the engine's step seconds over step tokens (a decayed
least-squares fit over its steps), i.e. what one more prefill token adds to a step, which is what a
recompute adds. It ignores attention's growth with length, so long sequences' recomputes are
underestimated: `auto` errs towards recomputing.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import attrs
import torch

from mstar_core.errors import ConfigError
from mstar_kvcache.config import OffloadSettings
from mstar_kvcache.pool import PagePool
from mstar_kvcache.sequence import Sequence


@attrs.define
class HostCopy:
    """A preempted sequence's first `num_computed` tokens' keys and values, in host `pages` (in order)."""

    pages: list[int]
    num_computed: int
    hashes: list[bytes]
    #: Leading pages the planned restore found still cached on the device (referenced there, not copied back).
    reused: int = 0


class StepCosts:
    """Running estimates, in seconds, of one page copied one way and of one more token in a step."""

    DECAY = 0.95  # per observation: the estimates follow the last few dozen steps and copies

    def __init__(self, page_seconds: float):
        self.page_seconds = page_seconds
        self._sums = [0.0] * 5  # decayed n, sum x, sum y, sum xx, sum xy of (step tokens, step seconds)

    def observe_copy(self, pages: int, seconds: float) -> None:
        if pages:
            self.page_seconds = self.DECAY * self.page_seconds + (1 - self.DECAY) * seconds / pages

    def observe_step(self, tokens: int, seconds: float) -> None:
        d = self.DECAY
        for i, value in enumerate((1.0, tokens, seconds, tokens * tokens, tokens * seconds)):
            self._sums[i] = d * self._sums[i] + value

    @property
    def token_seconds(self) -> float | None:
        """What one more token adds to a step: the fit's slope (the mean rate while step sizes barely vary)."""
        n, x, y, xx, xy = self._sums
        if n == 0 or x == 0:
            return None
        var = xx / n - (x / n) ** 2
        slope = (xy / n - (x / n) * (y / n)) / var if var > 1e-9 else 0.0
        return slope if slope > 0 else y / x

    def offload_pays(self, pages: int, tokens: int) -> bool:
        per_token = self.token_seconds
        return per_token is None or 2 * pages * self.page_seconds < tokens * per_token


class HostTier:
    """Host pages for one page pool: copies of preempted sequences, and spilled prefix pages keyed by digest."""

    def __init__(self, pool: PagePool, settings: OffloadSettings):
        self.pool, self.settings = pool, settings
        self.page_size = pool.page_size
        shape = list(pool.kv.shape)
        shape[2] = settings.host_pages
        # zeros, not empty: every host page is mapped now, not on a preemption's first copy (see pool.py)
        self.kv = torch.zeros(shape, dtype=pool.kv.dtype, pin_memory=pool.kv.device.type == "cuda")
        self._free: list[int] = list(range(settings.host_pages))  # a heap: low pages first, so copies run in slices
        self._spilled: OrderedDict[bytes, int] = OrderedDict()  # digest -> host page, least recently spilled first
        # digest -> host page of a full page inside a preempted sequence's copy: that content is on the host
        # already, so it is not spilled again and serves prefix hits as a spilled page would
        self._held: dict[bytes, int] = {}
        self.pages_out = self.pages_in = self.pages_reused = 0
        self.sequences = self.recomputes = self.host_full = 0
        self.pages_spilled = self.spill_hits = self.spills_dropped = 0
        self.copy_seconds = 0.0
        self.costs = StepCosts(0.0)
        self.costs.page_seconds = self._time_one_page()
        if settings.spill_prefixes:
            pool.spill = self.spill

    # -- preempted sequences ----------------------------------------------------------------------

    def save(self, seq: Sequence) -> bool:
        """Copy a sequence that is being preempted to host pages (before its pages are freed); False: recompute."""
        n = seq.num_computed
        count = -(-n // self.page_size)
        if count == 0 or seq.host is not None:
            return False
        rule = self.settings.rule
        if rule == "never" or n < self.settings.min_tokens or (rule == "auto" and not self.costs.offload_pays(count, n)):
            self.recomputes += 1
            return False
        pages = self._take(count)
        if pages is None:
            self.recomputes += 1
            self.host_full += 1
            return False
        self._move(self.pool.kv, seq.pages[:count], self.kv, pages)
        seq.host = HostCopy(pages, n, list(seq.hashes))
        for key, page in zip(seq.hashes, pages, strict=False):
            self._held.setdefault(key, page)
            spilled = self._spilled.pop(key, None)  # (the same content spilled earlier: one host copy is enough)
            if spilled is not None:
                heapq.heappush(self._free, spilled)
        self.pages_out += count
        self.sequences += 1
        return True

    def plan_restore(self, seq: Sequence) -> int:
        """Give a waiting offloaded sequence back its computed length (the scheduler then reserves its pages).

        At least one token is left to compute, as a prefix hit leaves one (an idle label restored for
        its readers then rewrites its last token's keys), so the step that restores it produces a row.
        """
        host = seq.host
        target = min(host.num_computed, len(seq.tokens) - 1)
        full = target // self.page_size
        host.reused = 0
        for key in host.hashes[:full]:  # (hashes exist only where prefix caching keys the sequence's pages)
            page = self.pool.lookup(key)
            if page is None:
                break
            self.pool.incref(page)
            seq.pages.append(page)
            host.reused += 1
        seq.num_computed = target
        seq.hashes = list(host.hashes[:full])
        return target

    def load(self, work: Iterable[tuple[Sequence, int]]) -> None:
        """Copy the keys and values of this step's restored sequences back into their reserved pages."""
        for seq, _ in work:
            host = seq.host
            if host is None or not seq.pages:
                continue
            count = -(-seq.num_computed // self.page_size)
            self._move(self.kv, host.pages[host.reused : count], self.pool.kv, seq.pages[host.reused : count])
            for i in range(host.reused, len(seq.hashes)):  # restored full pages serve later prefix hits again
                self.pool.register(seq.pages[i], seq.hashes[i])
            self.pages_in += count - host.reused
            self.pages_reused += host.reused
            self.discard(seq)

    def discard(self, seq: Sequence) -> None:
        """Free a sequence's host pages (restored, released, cancelled or dropped)."""
        if seq.host is not None:
            self._release(seq.host.pages, seq.host.hashes)
            seq.host = None

    def truncate(self, seq: Sequence, length: int) -> None:
        """Keep only the first `length` tokens of a host copy (its sequence was rolled back while preempted)."""
        host = seq.host
        if host is None or host.num_computed <= length:
            return
        keep, full = -(-length // self.page_size), length // self.page_size
        self._release(host.pages[full:], host.hashes[full:], free=len(host.pages) - keep)
        del host.pages[keep:]
        del host.hashes[full:]
        host.num_computed = length
        if not host.pages:
            seq.host = None

    # -- spilled prefix pages ---------------------------------------------------------------------

    def spill(self, page: int, key: bytes) -> None:
        """The pool is evicting cached `page` (digest `key`): keep a host copy (PagePool.allocate calls this)."""
        if key in self._spilled:
            self._spilled.move_to_end(key)
            return
        if key in self._held:
            return
        host = self._take(1)
        if host is None:  # every host page holds a preempted sequence
            self.spills_dropped += 1
            return
        self._move(self.pool.kv, [page], self.kv, host)
        self._spilled[key] = host[0]
        self.pages_spilled += 1

    def fetch(self, key: bytes) -> int | None:
        """A device page (one reference, cached under `key`) with the spilled page's keys and values; None: not here."""
        spilled = self._spilled.pop(key, None)
        host = spilled if spilled is not None else self._held.get(key)
        if host is None:
            return None
        if self.pool.num_available == 0:
            if spilled is not None:
                self._spilled[key] = spilled
            return None
        page = self.pool.allocate()  # (may spill another page: this one is out of the index, so it stays)
        self._move(self.kv, [host], self.pool.kv, [page])
        if spilled is not None:  # (a held page stays with its sequence's copy)
            heapq.heappush(self._free, spilled)
        self.pool.register(page, key)
        self.spill_hits += 1
        return page

    # -- internals --------------------------------------------------------------------------------

    def _release(self, pages: list[int], hashes: list[bytes], free: int | None = None) -> None:
        """Forget `hashes`' held pages, and free the last `free` of `pages` (all of them by default)."""
        for key, page in zip(hashes, pages, strict=False):
            if self._held.get(key) == page:
                del self._held[key]
        for page in pages[len(pages) - (len(pages) if free is None else free) :]:
            heapq.heappush(self._free, page)

    def _take(self, count: int) -> list[int] | None:
        """`count` host pages, evicting spilled prefix pages if needed; None (and no change) if they cannot be had."""
        if count > len(self._free) + len(self._spilled):
            return None
        while len(self._free) < count:
            _, page = self._spilled.popitem(last=False)
            heapq.heappush(self._free, page)
        return [heapq.heappop(self._free) for _ in range(count)]

    def _move(self, src: torch.Tensor, src_pages: list[int], dst: torch.Tensor, dst_pages: list[int]) -> None:
        """Copy pages between the pool and the host, a slice per run of consecutive pages on both sides."""
        started = time.perf_counter()
        with torch.no_grad():
            for a, b, n in _runs(src_pages, dst_pages):
                dst[:, :, b : b + n].copy_(src[:, :, a : a + n])  # (synchronous: timed, and safe to reuse at once)
        seconds = time.perf_counter() - started
        self.copy_seconds += seconds
        self.costs.observe_copy(len(src_pages), seconds)

    def _time_one_page(self) -> float:
        """Seconds one page takes one way (out and back, halved): the copy estimate before any real copy."""
        started = time.perf_counter()
        self._move(self.pool.kv, [0], self.kv, [0])
        self._move(self.kv, [0], self.pool.kv, [0])  # (page 0 is still empty: a copy of zeros onto zeros)
        seconds = (time.perf_counter() - started) / 2
        self.copy_seconds = 0.0
        return seconds

    def stats(self) -> dict[str, float]:
        return {
            "kv_host_pages_total": self.settings.host_pages,
            "kv_host_pages_used": self.settings.host_pages - len(self._free),
            "kv_host_pages_spilled": len(self._spilled),
            "kv_offloaded_sequences": self.sequences,
            "kv_pages_offloaded": self.pages_out,
            "kv_pages_restored": self.pages_in,
            "kv_pages_restored_in_place": self.pages_reused,
            "kv_offload_recomputes": self.recomputes,
            "kv_offload_host_full": self.host_full,
            "kv_prefix_pages_spilled": self.pages_spilled,
            "kv_prefix_spill_hits": self.spill_hits,
            "kv_prefix_spills_dropped": self.spills_dropped,
            "kv_offload_copy_seconds": self.copy_seconds,
            "kv_offload_page_seconds": self.costs.page_seconds,
            "kv_recompute_token_seconds": self.costs.token_seconds or 0.0,
        }


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """`(src start, dst start, length)` runs over which both page lists count up by one."""
    runs: list[tuple[int, int, int]] = []
    for a, b in zip(src, dst, strict=True):
        if runs and a == runs[-1][0] + runs[-1][2] and b == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((a, b, 1))
    return runs


def host_tier(settings: OffloadSettings | None, pool: PagePool, node: str, ranks: Any, share_with: str | None,
              ) -> HostTier | None:
    """The node's host tier, if its settings ask for one; a ConfigError naming the node where it cannot have one."""
    if settings is None:
        return None
    if ranks is not None:
        # (carrying the copies would be page ops in the step message, replayed by each rank on its own host pages;
        # not built yet)
        raise ConfigError(f"node '{node}': kvcache setting 'kv_offload' is not supported yet on a node split across "
                          f"ranks (tensor_parallel {ranks.world_size}); drop it")
    if share_with is not None:
        raise ConfigError(f"node '{node}': kvcache setting 'kv_offload' belongs on node '{share_with}', which owns the "
                          "pages this node reads (share_cache_with)")
    return HostTier(pool, settings)
