"""Cache labels of a `KVCacheEngine`: a request's labels made, forked copy-on-write, snapshotted and dropped."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from mstar_core.errors import RequestError
from mstar_core.runtime.engine import Invocation
from mstar_kvcache.blocks import BlockManager
from mstar_kvcache.inputs import ParsedInvocation
from mstar_kvcache.sequence import Sequence
from mstar_kvcache.step_inputs import StepForward


class Labels:
    """A node's sequences by (request, cache label): one `Sequence` per label, and the order they were made in.

    A dropped label gives its pages back (`blocks`) and the backend's per-sequence state with them (`forward`).
    """

    def __init__(self, node: str, blocks: BlockManager, forward: StepForward, device: torch.device):
        self.node, self.blocks, self.forward, self.device = node, blocks, forward, device
        self.seqs: dict[tuple[str, str], Sequence] = {}
        self._order = itertools.count()  # every sequence's admission order (FIFO ties), readers' included

    def next_order(self) -> int:
        return next(self._order)

    def create(self, request_id: str, label: str, arrival: float) -> Sequence:
        """A fresh sequence under `label` (replacing any sequence of that name)."""
        seq = Sequence(request_id, label, order=self.next_order(), arrival=arrival)
        self.seqs[seq.key] = seq
        return seq

    def sequence(self, inv: Invocation, parsed: ParsedInvocation) -> Sequence:
        """The sequence the call writes: its label's, forked from `fork_from` or made fresh if it has none yet."""
        key = (inv.request_id, parsed.label)
        seq = self.seqs.get(key)
        if seq is None:
            if parsed.fork_from is not None:
                self.fork(inv.request_id, parsed.fork_from, parsed.label)
                seq = self.seqs[key]
                if parsed.seed_offset is not None:
                    # a new sample of the parent's tokens (n > 1): its own random stream from seed + offset (set
                    # when this call attaches), nothing generated yet (the parent's tokens are its prompt)
                    seq.generator, seq.sampling, seq.generated, seq.grammar = None, None, [], None
                return seq
            seq = self.create(inv.request_id, parsed.label, inv.arrival)
        return seq

    def fork(self, request_id: str, src_label: str, dst_label: str) -> None:
        """Share `src_label`'s cache under `dst_label` copy-on-write (CFG branches, samples, n > 1).

        The fork is a copy of the label, random stream included: a seeded parent's generator is
        cloned as it stands, so a fork called with the parent's seed samples what the parent would
        have (and the same request repeats exactly). Give a branch its own seed to sample apart.
        """
        src = self.seqs.get((request_id, src_label))
        if src is None:
            raise RequestError(f"node '{self.node}': request {request_id} has no cache label '{src_label}' to fork")
        if (request_id, dst_label) in self.seqs:
            raise RequestError(f"node '{self.node}': cache label '{dst_label}' already exists for {request_id}")
        if src.pending is not None:
            raise RequestError(f"node '{self.node}': cannot fork '{src_label}' while a call on it is in flight")
        self._clone(src, dst_label)

    def _clone(self, src: Sequence, dst_label: str) -> Sequence:
        clone = self.blocks.fork(src, dst_label)
        clone.order = self.next_order()
        if src.generator is not None:  # its own generator at the parent's state: the two never share draws
            clone.generator = torch.Generator(device=src.generator.device)
            clone.generator.set_state(src.generator.get_state())
        if src.grammar is not None:  # its own matcher at the parent's state
            clone.grammar = src.grammar.fork()
        self.seqs[clone.key] = clone
        return clone

    def drop_label(self, request_id: str, label: str) -> None:
        """Forget one cache label of a request (its pages return to the pool unless shared)."""
        seq = self.seqs.get((request_id, label))
        if seq is None:
            return
        if seq.pending is not None:
            raise RequestError(f"node '{self.node}': cannot drop cache label '{label}' while a call on it is in flight")
        del self.seqs[seq.key]
        self.blocks.discard(seq)
        self.forward.forget(seq.order)

    def snapshot_label(self, request_id: str, src_label: str, dst_label: str) -> None:
        """Make `dst_label` a copy-on-write copy of `src_label` as it stands (replacing `dst_label`)."""
        if src_label == dst_label:
            return
        self.drop_label(request_id, dst_label)
        src = self.seqs.get((request_id, src_label))
        if src is None:  # snapshot of a label not written yet: an empty label
            src = Sequence(request_id, src_label)
        self._clone(src, dst_label)

    def release(self, request_id: str) -> list[int]:
        """Forget every label of a request; the orders of those whose backend state was dropped with them."""
        forgotten = []
        for key in [k for k in self.seqs if k[0] == request_id]:
            seq = self.seqs.pop(key)
            self.blocks.discard(seq)
            if self.forward.forget(seq.order):
                forgotten.append(seq.order)
        return forgotten

    def close(self) -> None:
        for seq in self.seqs.values():
            self.blocks.discard(seq)
        self.seqs.clear()

    def generator(self, seed: Any) -> torch.Generator | None:
        """A generator seeded with `seed` on the engine's device; None without a seed."""
        if seed is None:
            return None
        gen = torch.Generator(device=self.device)
        try:
            gen.manual_seed(seed)
        except (TypeError, ValueError, OverflowError, RuntimeError):
            # the edge checks seeds, but params can arrive by other paths: this one request fails, not the node
            raise RequestError(f"node '{self.node}': sampling 'seed' must be an integer in [0, 2**63 - 1], "
                               f"got {seed!r:.40}") from None
        return gen
