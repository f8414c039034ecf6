"""The forward pass of one `KVCacheEngine` step: ids, positions, embeddings and module tensors of its rows."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from mstar_kvcache.batch import build_batch, rope_positions
from mstar_kvcache.cross import CrossLabels
from mstar_kvcache.pool import PagePool
from mstar_kvcache.sequence import Sequence

if TYPE_CHECKING:
    from mstar_kvcache.lora import NodeAdapters
    from mstar_kvcache.replay import StepReplay


class StepBroadcast(Protocol):
    """What a step tells the other ranks of a split node before it runs (`ranks.StepLeader`, which itself runs a
    `StepForward` on the followers: named by this protocol so the two modules need not import each other)."""

    def send_step(self, ids: torch.Tensor | None, positions: torch.Tensor, batch: Any,
                  embeds: torch.Tensor | None, kwargs: dict[str, torch.Tensor]) -> None: ...


class StepForward:
    """Builds one step's module call from the scheduled rows and runs it (replayed where a recording stands for it).

    It owns what runs a step: the attention `backend` (and its per-sequence state, e.g. decode lanes), the
    `forward_fn` (the module, or its compiled form) and the `replay` of recorded decode steps. `module` is what
    `embed` is called on (on a split node's rank 0, the view that runs it on every rank: see `ranks.py`).
    """

    def __init__(self, module: Any, forward_fn: Any, backend: Any, replay: StepReplay | None, pool: PagePool,
                 device: torch.device, dtype: torch.dtype, axes: int, routed: bool, call_inputs: dict[str, str],
                 compiled: bool, leader: StepBroadcast | None, cross: CrossLabels | None = None):
        self.module, self.forward_fn, self.backend, self.replay = module, forward_fn, backend, replay
        self.pool, self.device, self.dtype, self.axes = pool, device, dtype, axes
        self.routed = routed  # the module takes per-token `routing` ids
        self.call_inputs = call_inputs  # module-declared call tensors: {name: "token" | "sequence"}
        self.compiled = compiled  # a compiled forward keeps its embeddings graph (see `splice_embeds`)
        self.leader = leader  # rank 0 of a split node: every rank runs each step (ranks.py)
        self.cross = cross  # cross-attention labels the step's sequences may attend to (cross.py)
        self.adapters: NodeAdapters | None = None  # the node's LoRA adapters, once enabled (lora.py)
        #: the step's logits `[rows, vocab]` where its replay ran the LM head too (the replay's buffer: valid until
        #: the next step); None: the answers compute them
        self.logits: torch.Tensor | None = None
        #: each row's argmax over `logits` where the step was run `greedy` and its replay computed them (the replay's
        #: buffer, as `logits`); None: the sampler picks the tokens
        self.tokens: torch.Tensor | None = None
        self._keep, self._greedy = True, False  # how the next run's results are used (`expect`)
        self._rows: list[int] | None = None
        #: the module's `forward` takes `rows=` (its optional declaration `forward_rows`: see contract.py)
        self.forward_rows = bool(getattr(module, "forward_rows", False))

    def expect(self, keep: bool, greedy: bool, rows: list[int] | None = None) -> None:
        """How the caller uses the next `run`'s results (that run only; then the defaults, `keep` and not `greedy`).

        `keep=False`: it reads the hidden rows only before the step after (a replayed step hands out its own buffer,
        not a copy); `greedy`: every row takes its argmax over unadjusted logits (a replay that runs the LM head then
        picks them too: `tokens`); `rows`: the only rows it reads (None: any). (Told ahead, not as arguments of
        `run`, which tests and benchmarks wrap.)
        """
        self._keep, self._greedy, self._rows = keep, greedy, rows

    def run(self, work: list[tuple[Sequence, int]]) -> torch.Tensor:
        """The final hidden rows of `work`'s rows, in order (see `expect`)."""
        keep, greedy, rows = self._keep, self._greedy, self._rows
        self._keep, self._greedy, self._rows = True, False, None
        if self.adapters is None:
            return self._run(work, False, keep, greedy, rows)
        try:  # rows under LoRA adapters: a compiled step, or a replay where the deltas are torch ops, would drop them
            eager = self.adapters.begin(work) or (self.compiled and self.adapters.has_rows)
            # (and every row runs every layer: the adapters' deltas are laid out over the step's rows)
            return self._run(work, eager, keep, greedy, None)
        finally:
            self.adapters.end()

    def _run(self, work: list[tuple[Sequence, int]], adapted: bool, keep: bool = True,
             greedy: bool = False, rows: list[int] | None = None) -> torch.Tensor:
        """`run`; with `adapted`, eagerly (the module itself, never a replay or the compiled forward)."""
        self.logits = self.tokens = None
        ids, batch = build_batch(work, self.pool.page_size, self.device)
        positions = rope_positions(work, batch, self.axes)
        kwargs = self.module_inputs(work, batch)
        embeds = self.splice_embeds(work, ids)
        context = self.backend.begin(batch, self.pool.kv)
        if self.cross is not None:
            context = self.cross.context(work, context)
        if self.leader is not None:
            self.leader.send_step(None if embeds is not None else ids, positions, batch, embeds, kwargs)
        forward_fn = self.module if adapted else self.forward_fn
        with torch.inference_mode():
            if embeds is None:
                if self.replay is not None and not kwargs and not adapted:
                    hidden = self.replay.forward(ids, positions, context, keep, greedy)
                    if hidden is not None:  # (a decode step replayed, or recorded as it ran)
                        self.logits, self.tokens = self.replay.logits, self.replay.tokens
                        return hidden
            if rows is not None and self.forward_rows and forward_fn is self.module and self.leader is None:
                # only the rows read go past the last layer's attention; the others are NaN, should one be read
                index = torch.tensor(rows, dtype=torch.long, device=self.device)
                kept = forward_fn(None if embeds is not None else ids, positions, context, input_embeds=embeds,
                                  rows=index, **kwargs)
                hidden = kept.new_full((ids.shape[0], kept.shape[1]), float("nan"))
                return hidden.index_copy_(0, index, kept)
            if embeds is None:
                return forward_fn(ids, positions, context, **kwargs)
            return forward_fn(None, positions, context, input_embeds=embeds, **kwargs)

    def run_followed(self, ids: torch.Tensor | None, positions: torch.Tensor, batch: Any, embeds: torch.Tensor | None,
                     kwargs: dict[str, torch.Tensor]) -> None:
        """A split node's follower: run the step rank 0 sent, on this rank's pool (its result is rank 0's to use)."""
        context = self.backend.begin(batch, self.pool.kv)
        if embeds is None:
            self.forward_fn(ids, positions, context, **kwargs)
        else:
            self.forward_fn(None, positions, context, input_embeds=embeds, **kwargs)

    def forget(self, order: int) -> bool:
        """Drop the backend's per-sequence state of sequence `order`; whether the backend keeps any."""
        forget = getattr(self.backend, "forget", None)  # backends may keep per-sequence state (decode lanes)
        if forget is None:
            return False
        forget(order)
        return True

    def module_inputs(self, work: list[tuple[Sequence, int]], batch: Any) -> dict[str, torch.Tensor]:
        """Routing ids and module-declared tensors for the step's rows (zeros where a call gave none)."""
        out: dict[str, torch.Tensor] = {}
        if self.routed:
            parts = [seq.routing[seq.num_computed : seq.num_computed + n] if seq.routing is not None else [0] * n
                     for seq, n in work]
            out["routing"] = torch.tensor([r for p in parts for r in p], dtype=torch.long, device=self.device)
        if not self.call_inputs:
            return out
        per_seq = False
        for name, kind in self.call_inputs.items():
            found = [(seq, n, [e for e in seq.extras if e[2] == name and e[0] < seq.num_computed + n
                               and e[1] > seq.num_computed]) for seq, n in work]
            sample = next((e[0][3] for _, _, e in found if e), None)
            if sample is None:
                continue
            if kind == "token":
                rows = []
                for seq, n, entries in found:
                    part = sample.new_zeros(n, *sample.shape[1:])
                    lo = seq.num_computed
                    for start, end, _, value, _ in entries:
                        a, b = max(lo, start), min(lo + n, end)
                        part[a - lo : b - lo] = value[a - start : b - start]
                    rows.append(part)
                out[name] = torch.cat(rows)
            else:
                per_seq = True
                out[name] = torch.stack([e[-1][3] if e else sample.new_zeros(sample.shape) for _, _, e in found])
        if per_seq:
            index = [i for i, (_, n) in enumerate(work) for _ in range(n)]
            out["sequence_index"] = torch.tensor(index, dtype=torch.long, device=self.device)
        return out

    def splice_embeds(self, work: list[tuple[Sequence, int]], ids: torch.Tensor) -> torch.Tensor | None:
        if not any(seq.embeds for seq, _ in work):
            return None
        spans = []
        row = 0
        for seq, n in work:
            lo, hi = seq.num_computed, seq.num_computed + n
            for start, rows in seq.embeds:
                a, b = max(lo, start), min(hi, start + rows.shape[0])
                if a < b:
                    spans.append((row + a - lo, row + b - lo, rows[a - start : b - start]))
            row += n
        if not spans and not self.compiled:
            # no row of this step is an embedding (decode steps after an embedded prompt): the module embeds
            # the ids itself, as `embed` would (a compiled forward keeps its embeddings graph: no new variant)
            return None
        with torch.inference_mode():
            if sum(b - a for a, b, _ in spans) == row:  # every row is an embedding: no token embedding needed
                embeds = spans[0][2].new_empty(row, spans[0][2].shape[1], dtype=self.dtype)
            else:
                embeds = self.module.embed(ids)
            for a, b, rows in spans:
                embeds[a:b] = rows.to(embeds.dtype)
        return embeds
