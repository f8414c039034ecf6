"""Calls entering a `KVCacheEngine`: parsed, attached to their label as its pending call, or queued behind one."""

from __future__ import annotations

from collections import deque

import torch

from mstar_core.errors import RequestError
from mstar_core.runtime.engine import Invocation, Result
from mstar_kvcache.cross import CrossLabels
from mstar_kvcache.inputs import ParsedInvocation, mask_limits, parse_invocation
from mstar_kvcache.labels import Labels
from mstar_kvcache.lora import NodeAdapters
from mstar_kvcache.rows import CallRows
from mstar_kvcache.sequence import Sequence


class CallIntake:
    """Attaches a writing call to its label's sequence, or queues it while another call on that label is in flight.

    It also holds the answers found without a forward pass (rejections, failed attaches, state transfers):
    the next step returns them.
    """

    def __init__(self, node: str, vocab_size: int | None, hidden_size: int | None, axes: int,
                 call_inputs: dict[str, str], max_model_len: int | None, device: torch.device, labels: Labels,
                 rows: CallRows, cross: CrossLabels | None = None):
        self.cross = cross  # the node's cross-attention labels, which a call may name (cross.py)
        self.node, self.vocab_size, self.hidden_size, self.axes = node, vocab_size, hidden_size, axes
        self.call_inputs, self.max_model_len, self.device = call_inputs, max_model_len, device
        self.labels, self.rows = labels, rows
        self.backlog: deque[Invocation] = deque()  # calls for a label that already has one in flight
        self.answered: list[Result] = []  # answered without a forward pass: rejections and state transfers
        self.adapters: NodeAdapters | None = None  # the node's LoRA adapters, once enabled (lora.py)

    def parse(self, inv: Invocation) -> ParsedInvocation:
        return parse_invocation(inv, self.vocab_size, self.hidden_size, self.axes, self.call_inputs)

    def take_answered(self) -> list[Result]:
        answered, self.answered = self.answered, []
        return answered

    def attach(self, seq: Sequence, inv: Invocation, parsed: ParsedInvocation) -> None:
        """Make `inv` the sequence's pending call. Everything that can fail runs before the sequence changes."""
        start = 0 if parsed.reset else len(seq.tokens)
        n = len(parsed.ids)
        if parsed.cross_label is not None and (self.cross is None or self.cross.labels.get(
                (seq.request_id, parsed.cross_label)) is None):
            raise RequestError(f"node '{self.node}': request {seq.request_id} has no cross label "
                               f"'{parsed.cross_label}'; send cross_states with the call that first names it")
        if self.max_model_len is not None and start + n > self.max_model_len:
            raise RequestError(
                f"node '{self.node}': sequence would reach {start + n} tokens, "
                f"over the model's limit of {self.max_model_len}; send a shorter input or fewer max_tokens"
            )
        generator = seq.generator
        if parsed.sampling is not None and (seq.sampling is None or parsed.sampling.seed != seq.sampling.seed):
            generator = self.labels.generator(parsed.sampling.seed)
        if parsed.reset and (seq.tokens or seq.pages):  # the label starts over: a fresh sequence, same name
            self.labels.drop_label(seq.request_id, seq.label)
            seq = self.labels.create(inv.request_id, parsed.label, inv.arrival)
        if self.adapters is not None:
            self.adapters.bind(seq, parsed.lora)
        elif parsed.lora is not None:
            raise RequestError(f"node '{self.node}': LoRA adapter '{parsed.lora}' asked for, but this node serves no "
                               "adapters", status=404, param="model")
        for name in parsed.snapshot_before:
            self.labels.snapshot_label(seq.request_id, seq.label, name)
        limits = None
        if parsed.bidirectional or parsed.frame_size is not None or parsed.blocks is not None:
            limits = mask_limits(start, n, parsed.bidirectional, parsed.frame_size, parsed.blocks)
        if limits is not None or seq.limits is not None:
            if seq.limits is None:
                seq.limits = list(range(1, start + 1))
            seq.limits.extend(limits or range(start + 1, start + n + 1))
            seq.cacheable = False  # a page's keys depend on tokens after it, not just on those before
        if (parsed.embeds or parsed.extras or parsed.positions is not None or parsed.routing is not None
                or seq.positions is not None or seq.routing is not None):  # (a plain token call records nothing)
            self.append_inputs(seq, parsed, start)
        seq.chunkable = limits is None
        if self.cross is not None:
            self.cross.bind(seq, parsed, start)
        seq.tokens.extend(parsed.ids)
        seq.pending, seq.pending_start, seq.call = inv, start, parsed
        # each call's: the request's arrival, or its submission on a node with call_order "fifo" (a fork, a snapshot
        # or a moved cache made the sequence without one)
        seq.priority, seq.arrival = inv.priority, inv.arrival
        seq.collected, seq.stepped = [], []
        seq.gathers = self.rows.wanted(parsed)
        seq.rows_from = self.rows.first(parsed, start) if seq.gathers else None
        if parsed.sampling is not None:
            seq.generator, seq.sampling = generator, parsed.sampling

    def append_inputs(self, seq: Sequence, parsed: ParsedInvocation, start: int) -> None:
        """Record the call's embeddings, positions, routing ids and module tensors at token `start` on."""
        n = len(parsed.ids)
        for offset, rows in parsed.embeds:
            seq.embeds.append((start + offset, rows.to(self.device)))
        if parsed.positions is not None or seq.positions is not None:
            before = seq.positions if seq.positions is not None else torch.arange(start).expand(self.axes, -1)
            new = parsed.positions
            if new is None:  # implicit positions continue after the largest one so far
                new = (torch.arange(n) + seq.next_position).expand(self.axes, -1)
            seq.positions = torch.cat((before, new), dim=1)
        if parsed.routing is not None or seq.routing is not None:
            seq.routing = (seq.routing if seq.routing is not None else [0] * start) + (parsed.routing or [0] * n)
        for name, (value, per_token) in parsed.extras.items():
            seq.extras.append((start, start + n, name, value.to(self.device), per_token))

    def attach_backlog(self, seq: Sequence) -> None:
        """The sequence's call is done: attach the next call queued for its label, if any."""
        if not self.backlog:
            return
        for inv in list(self.backlog):
            if inv.request_id == seq.request_id and inv.options.get("cache_label", "main") == seq.label:
                self.backlog.remove(inv)
                try:
                    parsed = self.parse(inv)
                    self.attach(self.labels.seqs.get(seq.key) or self.labels.sequence(inv, parsed), inv, parsed)
                except Exception as exc:
                    self.answered.append((inv, exc))
                    continue
                return

    def release(self, request_id: str) -> None:
        self.backlog = deque(inv for inv in self.backlog if inv.request_id != request_id)
        self.answered = [r for r in self.answered if r[0].request_id != request_id]

    def request_ids(self) -> set[str]:
        return {i.request_id for i in self.backlog} | {r[0].request_id for r in self.answered}
