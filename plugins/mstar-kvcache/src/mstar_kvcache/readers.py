"""Read-only calls of a `KVCacheEngine`: attend to frozen labels (this node's or, with `share_cache_with`,
the owner node's) plus the call's own tokens, which are never stored and take no page."""

from __future__ import annotations

import torch

from mstar_core.errors import RequestError
from mstar_core.runtime.engine import Invocation, Result
from mstar_kvcache.batch import context_slots
from mstar_kvcache.inputs import ParsedInvocation, mask_limits
from mstar_kvcache.labels import Labels
from mstar_kvcache.pool import PagePool
from mstar_kvcache.rows import CallRows
from mstar_kvcache.sequence import Sequence


class ReadOnlyCalls:
    """Read-only calls: waiting until the labels they read are all cached, then attached as transient sequences
    that hold references to those labels' pages until they are answered."""

    def __init__(self, node: str, share_with: str | None, labels: Labels, source: Labels, pool: PagePool,
                 device: torch.device, axes: int, rows: CallRows):
        self.node, self.share_with = node, share_with
        self.labels = labels  # this node's: a reader's order and random stream come from here
        self.source = source  # the labels read: this node's, or with `share_cache_with` the owner node's
        self.pool, self.device, self.axes, self.rows = pool, device, axes, rows
        self.waiting: list[tuple[Invocation, ParsedInvocation]] = []  # not attached yet
        self.attached: list[Sequence] = []  # attached (they hold references to their pages)

    def attach_waiting(self) -> list[Result]:
        """Attach waiting calls whose labels are all cached; the failures of those that cannot attach."""
        waiting, self.waiting = self.waiting, []
        failed: list[Result] = []
        for inv, parsed in waiting:
            try:
                labels = [self.source.seqs.get((inv.request_id, name)) for name in parsed.read_labels]
                if self.share_with is not None and any(s is None for s in labels):
                    missing = [n for n, s in zip(parsed.read_labels, labels, strict=True) if s is None]
                    raise RequestError(f"node '{self.node}': node '{self.share_with}' holds no cache label "
                                       f"{missing} for request {inv.request_id}")
                labels = [s for s in labels if s is not None]
                busy = [s for s in labels if s.pending is not None or s.remaining]
                if busy:
                    for s in busy:  # a preempted idle label is recomputed for its readers
                        s.recompute = s.recompute or s.pending is None
                    self.waiting.append((inv, parsed))
                    continue
                self.attached.append(self._reader(inv, parsed, labels))
            except Exception as exc:
                failed.append((inv, exc))
        return failed

    def _reader(self, inv: Invocation, parsed: ParsedInvocation, labels: list[Sequence]) -> Sequence:
        """A read-only call as a transient sequence: the frozen labels' tokens, then its own (never stored)."""
        ctx = sum(len(s.tokens) for s in labels)
        n = len(parsed.ids)
        first = labels[0] if labels else None
        tokens = labels[0].tokens + parsed.ids if len(labels) == 1 else [t for s in labels for t in s.tokens] + parsed.ids
        reader = Sequence(inv.request_id, parsed.label, order=self.labels.next_order(), arrival=inv.arrival, readonly=True,
                          tokens=tokens, num_computed=ctx,
                          context=[(list(s.pages), len(s.tokens)) for s in labels], chunkable=False,
                          generated=list(first.generated) if first else [], priority=inv.priority)
        if any(s.positions is not None for s in labels) or parsed.positions is not None:
            parts = [s.positions if s.positions is not None else torch.arange(len(s.tokens)).expand(self.axes, -1)
                     for s in labels]
            before = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1) if parts
                      else torch.zeros(self.axes, 0, dtype=torch.long))
            new = parsed.positions
            if new is None:  # implicit positions continue after the largest one so far (after the tokens if none)
                new = (torch.arange(n) + (int(before.max()) + 1 if before.shape[1] else ctx)).expand(self.axes, -1)
            reader.positions = torch.cat((before, new), dim=1)
        limits = mask_limits(ctx, n, parsed.bidirectional, parsed.frame_size, parsed.blocks)
        if limits is not None:
            reader.limits = [0] * ctx + limits  # only the own rows' bounds are read
        self._append_inputs_reader(reader, parsed, ctx)
        sampling = parsed.sampling or (first.sampling if first else None)
        reader.sampling = sampling
        if parsed.sampling is not None and (first is None or first.sampling is None
                                            or parsed.sampling.seed != first.sampling.seed):
            reader.generator = self.labels.generator(parsed.sampling.seed)
        elif first is not None:
            reader.generator = first.generator  # today's semantics: the label's random stream advances
        for pages, _ in reader.context:
            for page in pages:
                self.pool.incref(page)
        reader.context_slots = self._frozen_slots(labels)
        reader.pending, reader.pending_start, reader.call = inv, ctx, parsed
        reader.gathers = self.rows.wanted(parsed)
        return reader

    def _frozen_slots(self, labels: list[Sequence]) -> torch.Tensor:
        """The flat slots of the labels' keys, in order; each label keeps its own until its tokens or pages change
        (the steps of a flow or a denoising loop read the same frozen prefix call after call)."""
        parts = []
        for s in labels:
            memo = s.frozen_slots
            if memo is None or memo[0] != len(s.tokens) or memo[1] != s.pages:
                slots = context_slots([(s.pages, len(s.tokens))], self.pool.page_size).to(self.device)
                memo = s.frozen_slots = (len(s.tokens), list(s.pages), slots)
            parts.append(memo[2])
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=self.device)

    def _append_inputs_reader(self, reader: Sequence, parsed: ParsedInvocation, ctx: int) -> None:
        n = len(parsed.ids)
        for offset, rows in parsed.embeds:
            reader.embeds.append((ctx + offset, rows.to(self.device)))
        if parsed.routing is not None:
            reader.routing = [0] * ctx + parsed.routing
        for name, (value, per_token) in parsed.extras.items():
            reader.extras.append((ctx, ctx + n, name, value.to(self.device), per_token))

    def drop(self, reader: Sequence) -> None:
        """Let go of an attached reader's page references (answered, failed or released)."""
        if reader in self.attached:
            self.attached.remove(reader)
            for pages, _ in reader.context:
                for page in pages:
                    self.pool.decref(page)
            reader.context = []

    def release(self, request_id: str) -> None:
        for reader in [r for r in self.attached if r.request_id == request_id]:
            self.drop(reader)
        self.waiting = [w for w in self.waiting if w[0].request_id != request_id]

    def request_ids(self) -> set[str]:
        return {r.request_id for r in self.attached} | {w[0].request_id for w in self.waiting}

    def close(self) -> None:
        for reader in list(self.attached):
            self.drop(reader)
