"""The forward pass of one `KVCacheEngine` step: ids, positions, embeddings and module tensors of its rows."""

from __future__ import annotations

from typing import Any

import torch

from mstar_kvcache.batch import build_batch, rope_positions
from mstar_kvcache.sequence import Sequence


class StepInputs:
    """Mixin of `KVCacheEngine`: builds one step's module call from the scheduled rows."""

    def _forward(self, work: list[tuple[Sequence, int]]) -> torch.Tensor:
        ids, batch = build_batch(work, self.pool.page_size, self.device)
        positions = rope_positions(work, batch, self.axes)
        kwargs = self._module_inputs(work, batch)
        embeds = self._splice_embeds(work, ids)
        context = self.backend.begin(batch, self.pool.kv)
        if self.ranks is not None and self.ranks.leader:  # a split node: every rank runs this step (ranks.py)
            self._send_step(None if embeds is not None else ids, positions, batch, embeds, kwargs)
        with torch.inference_mode():
            if embeds is None:
                if self.replay is not None and not kwargs:
                    hidden = self.replay.forward(ids, positions, context)
                    if hidden is not None:  # (a decode step replayed, or recorded as it ran)
                        return hidden
                return self.forward_fn(ids, positions, context, **kwargs)
            return self.forward_fn(None, positions, context, input_embeds=embeds, **kwargs)

    def _module_inputs(self, work: list[tuple[Sequence, int]], batch: Any) -> dict[str, torch.Tensor]:
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

    def _splice_embeds(self, work: list[tuple[Sequence, int]], ids: torch.Tensor) -> torch.Tensor | None:
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
        if not spans and not self.settings.compile:
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
