"""Continuous-batching policy: which sequences run this step and how many tokens each (no model code)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs

from mstar_core.runtime.engine import is_background
from mstar_kvcache.blocks import BlockManager
from mstar_kvcache.sequence import Sequence


@attrs.define
class Schedule:
    """One step's work: `(sequence, tokens to run)` in batch order, and who was preempted to make room."""

    work: list[tuple[Sequence, int]] = attrs.field(factory=list)
    preempted: list[Sequence] = attrs.field(factory=list)
    too_large: list[Sequence] = attrs.field(factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.work)


def _decodes(seq: Sequence) -> bool:
    """Whether `seq`'s work is a decode: one new token, or one and the drafts speculative decoding guessed after it."""
    return seq.remaining == 1 or (seq.speculation is not None and bool(seq.speculation.drafts))


def _rank(seq: Sequence) -> tuple[float, float, int]:
    # higher priority first (a stream running dry), then the oldest request, then first come first served: a
    # request's later calls (a decode, a flow step's read-only branch) keep their request's place
    return (-seq.priority, seq.arrival, seq.order)


class Scheduler:
    """Fills a token budget: sequences that already hold pages first (decodes, chunked prefills), then new ones.

    A sequence that cannot get pages preempts the lowest-ranked holder of pages that is not in this
    step (its cache is dropped and recomputed later, or copied to the host tier and back: offload.py); new sequences only wait, except that when
    nothing at all can run, idle holders are preempted so the engine never deadlocks.
    """

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 background_step_tokens: int = 8, background_step_rows: int = 1,
                 prefill_step_tokens: int | None = None):
        if min(max_num_seqs, max_num_batched_tokens, background_step_tokens, background_step_rows,
               1 if prefill_step_tokens is None else prefill_step_tokens) < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens, background_step_tokens, background_step_rows "
                             "and prefill_step_tokens must be >= 1")
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        #: tokens background sequences (`runtime.engine.BACKGROUND_PRIORITY`: Batch API lines) may add to a step
        #: that live ones have work in: a background prefill then goes in small chunks instead of stretching the
        #: live rows' step (their inter-token latency); with no live work they take the whole budget
        self.background_step_tokens = background_step_tokens
        #: background sequences that may share a step live ones have work in: each background decode row is one more
        #: row of the live rows' step (on a busy CPU, what it computes), so beside live work they take turns
        self.background_step_rows = background_step_rows
        #: prompt tokens (prefills, their chunks, recomputes) a step may take while it carries decode rows; None: the
        #: whole budget. A step's time grows with its prompt tokens, and every decoding stream waits for the step:
        #: smaller prompt chunks keep the decode rows flowing, and a burst of arrivals gets its first tokens one
        #: prompt after another instead of all at the end of one long step (TTFT p50 under load)
        self.prefill_step_tokens = prefill_step_tokens

    def schedule(self, pending: Iterable[Sequence], holders: Callable[[], Iterable[Sequence]]) -> Schedule:
        """Plan a step over sequences with work (`pending`); `holders()` lists every sequence holding pages."""
        out = Schedule()
        chosen: set[int] = set()
        budget = self.max_num_batched_tokens
        ordered = sorted(pending, key=_rank)
        live = any(not is_background(s.priority) for s in ordered)
        background_left = [self.background_step_tokens if live else budget]  # tokens
        background_rows = [self.background_step_rows if live else self.max_num_seqs]
        decoding = self.prefill_step_tokens is not None and any(s.pages and _decodes(s) for s in ordered)
        prompt_left = [self.prefill_step_tokens if decoding else budget]  # tokens

        def room(seq: Sequence) -> int:  # the tokens `seq` may take now
            # (a block that must run in one piece is held back by the step's budget only, or it would starve)
            mine = budget if _decodes(seq) or not seq.chunkable else min(budget, max(0, prompt_left[0]))
            if not is_background(seq.priority):
                return mine
            return min(mine, background_left[0]) if background_rows[0] > 0 else 0

        def took(seq: Sequence, n: int) -> None:
            if not _decodes(seq):
                prompt_left[0] -= n
            if is_background(seq.priority):
                background_left[0] -= n
                background_rows[0] -= 1

        running = [s for s in ordered if s.pages]
        waiting = [s for s in ordered if not s.pages]
        for seq in running:
            if len(out.work) >= self.max_num_seqs or budget <= 0:
                break
            if not seq.pages:  # preempted earlier in this step to make room
                continue
            n = self._chunk(seq, room(seq), bool(out.work))
            if n == 0:
                continue
            while not self.blocks.reserve(seq, n):
                victim = self._victim(holders(), chosen, exclude=seq)
                if victim is None or (victim.pending is not None and _rank(victim) < _rank(seq)):
                    self._preempt(seq, out)
                    break
                self._preempt(victim, out)
            else:
                out.work.append((seq, n))
                chosen.add(id(seq))
                budget -= n
                took(seq, n)
        for seq in waiting:
            if out.preempted or len(out.work) >= self.max_num_seqs or budget <= 0:
                break
            if seq.readonly:  # a read-only call takes no pages: it only needs room in the token budget
                n = self._chunk(seq, room(seq), bool(out.work))
                if n == 0:
                    break
                out.work.append((seq, n))
                budget -= n
                took(seq, n)
                continue
            if self.blocks.total_pages(seq) > self.blocks.pool.num_pages:
                out.too_large.append(seq)
                continue
            self.blocks.match_prefix(seq)
            n = self._chunk(seq, room(seq), bool(out.work))
            if n == 0:
                self.blocks.free(seq)
                break
            admitted = self.blocks.reserve(seq, n)
            while not admitted and not out.work:
                victim = self._victim(holders(), chosen, exclude=seq, idle_only=True)
                if victim is None:
                    break
                self._preempt(victim, out)
                admitted = self.blocks.reserve(seq, n)
            if not admitted:
                self.blocks.free(seq)
                break  # FIFO: later arrivals do not jump the queue
            out.work.append((seq, n))
            chosen.add(id(seq))
            budget -= n
            took(seq, n)
        return out

    def _chunk(self, seq: Sequence, budget: int, batch_nonempty: bool) -> int:
        if seq.chunkable:
            return min(seq.remaining, budget)
        # a non-causal block must be computed in one piece; it may overrun the budget only alone
        return seq.remaining if seq.remaining <= budget or not batch_nonempty else 0

    def _victim(self, holders: Iterable[Sequence], chosen: set[int], exclude: Sequence, idle_only: bool = False):
        candidates = [
            s for s in holders if s.pages and id(s) not in chosen and s is not exclude and not (idle_only and s.pending)
        ]
        return max(candidates, key=_rank, default=None)

    def _preempt(self, seq: Sequence, out: Schedule) -> None:
        self.blocks.preempt(seq)  # (to the host tier, where the engine has one: see offload.py)
        out.preempted.append(seq)
