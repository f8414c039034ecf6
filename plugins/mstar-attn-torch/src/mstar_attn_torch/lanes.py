"""`DecodeLanes`: contiguous per-sequence copies of decoding sequences' keys and values.

Gathering every page of every decoding sequence in every layer costs as much as the attention
itself on a CPU. A lane holds one sequence's keys and values contiguously (all layers), so a
decode step attends over a strided view of the lanes with no gather: a lane is filled from the
pages once, when its sequence starts decoding, and then gets one new token per step, written
next to the page write. The pages stay the source of truth: a lane is trusted only while its
recorded length and page list still describe the sequence (anything else, such as a rollback, a
copy-on-write or a preemption, refills it from the pages).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch


class DecodeLanes:
    """Lane storage `[layers, 2, lanes, capacity, kv_heads, head_dim]` (a view of head-major memory), grown on demand within `budget_bytes`."""

    def __init__(self, budget_bytes: int, dtype: torch.dtype | None = None):
        self.budget = budget_bytes
        self.dtype = dtype  # None: the pool's (a bf16 pool on CPU keeps fp32 lanes: its decode attention runs in fp32)
        self.kv: torch.Tensor | None = None
        self.owner: list[Hashable | None] = []
        self.length: list[int] = []
        self.pages: list[list[int]] = []
        self.used: list[int] = []  # step a lane was last used in (LRU eviction)
        self.lane_of: dict[Hashable, int] = {}
        self.step = 0

    @property
    def num_lanes(self) -> int:
        return len(self.owner)

    @property
    def capacity(self) -> int:
        return 0 if self.kv is None else self.kv.shape[3]

    def forget(self, key: Hashable) -> None:
        """Free the lane of a sequence that is gone, moving the highest held lane into it.

        Lanes stay packed at the front, so a step's attention never spans holes left by finished
        sequences (it runs over every lane up to the highest one in use).
        """
        lane = self.lane_of.pop(key, None)
        if lane is None:
            return
        self.owner[lane] = None
        last = max((i for i, o in enumerate(self.owner) if o is not None), default=-1)
        if last > lane:
            held = max(self.length[last], 0)
            self.kv[:, :, lane, :held] = self.kv[:, :, last, :held]
            moved = self.owner[last]
            self.owner[lane], self.length[lane], self.pages[lane], self.used[lane] = (
                moved, self.length[last], self.pages[last], self.used[last])
            self.lane_of[moved] = lane
            self.owner[last], self.length[last], self.pages[last] = None, -1, []

    def assign(self, pool: torch.Tensor, keys: list[Hashable], page_lists: list[list[int]], kv_lens: list[int]) -> list[int | None]:
        """A lane for each decoding sequence (None: no room, attend through the pages), with earlier tokens in it.

        `kv_lens[i]` counts sequence `i`'s keys including this step's one, which the caller writes.
        """
        self.step += 1
        if len(set(keys)) != len(keys):  # ids are not unique: no lane can be trusted
            return [None] * len(keys)
        page_size = pool.shape[3]
        live = len(self.lane_of) + sum(k not in self.lane_of for k in keys)  # (lane_of holds every owned lane)
        self._reserve(pool, max(len(keys), live), max(kv_lens))
        lanes: list[int | None] = []
        for key, pages, kv_len in zip(keys, page_lists, kv_lens, strict=True):
            lane = self.lane_of.get(key)
            stale = (
                lane is None
                or self.length[lane] != kv_len - 1
                or pages[: len(self.pages[lane])] != self.pages[lane]
            )
            if lane is None:
                lane = self._take(key)
            if lane is None or kv_len > self.capacity:
                lanes.append(None)
                continue
            if stale:
                known = kv_len - 1
                held = -(-known // page_size)
                if known:
                    src = pool[:, :, pages[:held]].flatten(2, 3)[:, :, :known]
                    self.kv[:, :, lane, :known] = src
            self.length[lane], self.pages[lane], self.used[lane] = kv_len, list(pages), self.step
            lanes.append(lane)
        return lanes

    def _take(self, key: Hashable) -> int | None:
        """A free lane, else the least recently used one not needed in this step."""
        free = [i for i, o in enumerate(self.owner) if o is None]
        if free:
            lane = free[0]
        else:
            idle = [i for i in range(self.num_lanes) if self.used[i] < self.step]
            if not idle:
                return None
            lane = min(idle, key=self.used.__getitem__)
            del self.lane_of[self.owner[lane]]
        self.owner[lane] = key
        self.lane_of[key] = lane
        self.length[lane] = -1
        self.pages[lane] = []
        return lane

    def _reserve(self, pool: torch.Tensor, lanes: int, length: int) -> None:
        """Grow to at least `lanes` lanes of `length` tokens (with headroom when the budget allows)."""
        if lanes <= self.num_lanes and length <= self.capacity:
            return
        layers, _, _, _, heads, dim = pool.shape
        dtype = self.dtype or pool.dtype
        per_token = 2 * layers * heads * dim * torch.empty((), dtype=dtype).element_size()
        # doubling lanes and length keeps regrowth (a full copy: 0.1-0.35 s each for SmolLM2 at c=32, when lanes
        # grew 8 at a time) rare; without room for that, grow only to what is needed
        needed_lanes = max(self.num_lanes, _round(lanes, 8))
        needed_cap = max(self.capacity, _round(length, 16))
        doubled_lanes = max(needed_lanes, 2 * self.num_lanes) if lanes > self.num_lanes else needed_lanes
        doubled_cap = max(self.capacity, _round(max(length, 2 * self.capacity, 64), 16)) if length > self.capacity else needed_cap
        # last resort: more lanes, each only as long as this step needs (a few long sequences grew the lanes
        # before many short ones came: without it, every lane beyond the first few attended through the pages)
        for want_lanes, cap in ((doubled_lanes, doubled_cap), (needed_lanes, doubled_cap), (doubled_lanes, needed_cap),
                                (needed_lanes, needed_cap), (needed_lanes, _round(length, 16))):
            if want_lanes * cap * per_token <= self.budget:
                break
        else:
            return  # rows that do not fit attend through the pages
        # head-major memory, token-major view: a lane's keys per head are one contiguous [length, dim]
        # block (decode attention over them runs ~15-30 % faster than over token-major lanes), while
        # indexing `kv[layer, k/v, lane, position]` reads and writes a token's [heads, dim] as before
        grown = pool.new_zeros(layers, 2, want_lanes, heads, cap, dim, dtype=dtype).transpose(3, 4)
        if self.kv is not None:
            kept = min(cap, self.capacity)
            grown[:, :, : self.num_lanes, :kept] = self.kv[:, :, :, :kept]
            for lane, held in enumerate(self.length):
                if held > cap:  # (shorter lanes: this lane no longer holds its sequence, which refills if it fits)
                    self.length[lane], self.pages[lane] = -1, []
        self.kv = grown
        extra = want_lanes - self.num_lanes
        self.owner += [None] * extra
        self.length += [-1] * extra
        self.pages += [[] for _ in range(extra)]
        self.used += [0] * extra


def _round(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
