"""`PagedBatch`: one step's packed-token layout over the page tables, built once and shared by every layer."""

from __future__ import annotations

import itertools

import attrs
import torch

from mstar_kvcache.sequence import Sequence


@attrs.define(eq=False)
class PagedBatch:
    """What an attention backend needs for one step (sequence `i` owns packed rows `q_start[i]:q_start[i+1]`).

    `kv_lens[i]` counts the keys sequence `i` attends to once this step's keys are written;
    `page_table[i, :num_pages[i]]` lists its pages. `slot_mapping[t]` is the flat slot
    (`page * page_size + offset`) where the key and value of written row `t` go: every row, or the
    rows `write_rows` when some sequences are read-only. `positions[t]` is the row's index in its
    sequence (its key position; RoPE positions are the model's business and may differ). `limits` is
    None for plain causal attention; otherwise `limits[t]` is the exclusive bound on key positions
    row `t` sees (`position + 1` is causal, a block end makes a bidirectional block). `seq_ids[i]`
    identifies sequence `i` across steps, for backends that keep per-sequence state between steps.

    Read-only sequences (`readonly`, their indices) write nothing: sequence `i` attends to the frozen
    keys at `context_slots[i]` (flat slots, in order; `context_pages[i]` gives the same as
    `(pages, length)` segments) followed by its own rows' keys, which live only in this step. Its key
    positions run `0 .. len(context) + q_len`, its own rows sitting after the context.
    """

    page_size: int
    q_lens: list[int]
    kv_lens: list[int]
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    page_lists: list[list[int]]
    # `q_start` and `page_table`: given, or made from `row_starts` and `page_lists` when first read (a step whose rows
    # all decode in lanes reads neither: two tensors fewer a step, each ~10-20 us right after a replayed step)
    _q_start: torch.Tensor | None = attrs.field(default=None, alias="q_start", kw_only=True)
    _page_table: torch.Tensor | None = attrs.field(default=None, alias="page_table", kw_only=True)
    limits: torch.Tensor | None = None
    seq_ids: list[int] | None = None
    write_rows: torch.Tensor | None = None
    readonly: list[int] = attrs.field(factory=list)
    context_slots: dict[int, torch.Tensor] = attrs.field(factory=dict)
    context_pages: dict[int, list[tuple[list[int], int]]] = attrs.field(factory=dict)
    #: `q_start` as a Python list (backends read it per step; None when built by other means).
    row_starts: list[int] | None = None

    @property
    def q_start(self) -> torch.Tensor:
        """`[num_seqs + 1]` int64: sequence `i`'s packed rows are `q_start[i]:q_start[i+1]`."""
        if self._q_start is None:
            starts = self.row_starts if self.row_starts is not None else [0, *itertools.accumulate(self.q_lens)]
            self._q_start = torch.tensor(starts, dtype=torch.long, device=self.positions.device)
        return self._q_start

    @property
    def page_table(self) -> torch.Tensor:
        """`[num_seqs, widest]` int64: sequence `i`'s pages, padded with page 0."""
        if self._page_table is None:
            lists = self.page_lists
            width = max(1, max((len(p) for p in lists), default=0))
            self._page_table = torch.tensor([p + [0] * (width - len(p)) for p in lists], dtype=torch.long,
                                            device=self.positions.device)
        return self._page_table

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def all_decode(self) -> bool:
        """Every sequence runs exactly one new token (the decode fast path)."""
        return all(n == 1 for n in self.q_lens)


def _extend_slots(out: list[int], pages: list[int], start: int, n: int, page_size: int) -> None:
    """Append the flat slots of key positions `start .. start+n-1` (one range per page touched)."""
    pos, end = start, start + n
    while pos < end:
        page, offset = divmod(pos, page_size)
        take = min(page_size - offset, end - pos)
        first = pages[page] * page_size + offset
        out.extend(range(first, first + take))
        pos += take


def context_slots(context: list[tuple[list[int], int]], page_size: int) -> torch.Tensor:
    """Flat slots of frozen keys: each `(pages, length)` segment's first `length` keys, in order."""
    slots: list[int] = []
    for pages, length in context:
        _extend_slots(slots, pages, 0, length, page_size)
    return torch.tensor(slots, dtype=torch.long)


def build_batch(work: list[tuple[Sequence, int]], page_size: int, device: torch.device) -> tuple[torch.Tensor, PagedBatch]:
    """Packed input ids `[T]` and the batch layout for `(sequence, tokens to run)` pairs.

    Built with Python lists and one tensor per field: per-step bookkeeping is a few small tensor
    creations whatever the batch (a decode step of 32 rows used to pay ~15 tensor ops).
    """
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts: list[int] = []
    q_lens: list[int] = []
    kv_lens: list[int] = []
    row_starts = [0]
    write_rows: list[int] = []  # rows whose keys are stored (a tensor only when some sequence is read-only)
    readonly: list[int] = []
    any_limits = False
    for i, (seq, n) in enumerate(work):
        start = seq.num_computed
        starts.append(start)
        q_lens.append(n)
        kv_lens.append(start + n)
        row = row_starts[-1]
        row_starts.append(row + n)
        any_limits = any_limits or seq.limits is not None
        if n == 1:
            ids.append(seq.tokens[start])
            positions.append(start)
        else:
            ids.extend(seq.tokens[start : start + n])
            positions.extend(range(start, start + n))
        if seq.readonly:
            readonly.append(i)
            continue
        if n == 1:
            write_rows.append(row)
            page, offset = divmod(start, page_size)
            slots.append(seq.pages[page] * page_size + offset)
        else:
            write_rows.extend(range(row, row + n))
            _extend_slots(slots, seq.pages, start, n, page_size)
    page_lists = [list(seq.pages) for seq, _ in work]
    limits = None
    if any_limits:
        bounds: list[int] = []
        for (seq, n), start in zip(work, starts, strict=True):
            if seq.limits is None:
                bounds.extend(range(start + 1, start + n + 1))
            else:
                bounds.extend(seq.limits[start : start + n])
        limits = torch.tensor(bounds, dtype=torch.long, device=device)
    batch = PagedBatch(
        page_size=page_size,
        q_lens=q_lens,
        kv_lens=kv_lens,
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        page_lists=page_lists,
        limits=limits,
        seq_ids=[seq.order for seq, _ in work],
        write_rows=torch.tensor(write_rows, dtype=torch.long, device=device) if readonly else None,
        readonly=readonly,
        context_slots={i: _context_slots(work[i][0], page_size).to(device) for i in readonly},
        context_pages={i: [(list(p), n) for p, n in work[i][0].context] for i in readonly},
        row_starts=row_starts,
    )
    return torch.tensor(ids, dtype=torch.long, device=device), batch


def _context_slots(reader: Sequence, page_size: int) -> torch.Tensor:
    """A read-only sequence's frozen-key slots (the engine sets them when the call attaches)."""
    if reader.context_slots is None:
        reader.context_slots = context_slots(reader.context, page_size)
    return reader.context_slots


def rope_positions(work: list[tuple[Sequence, int]], batch: PagedBatch, axes: int) -> torch.Tensor:
    """The RoPE positions handed to the module: `[T]` (one axis) or `[axes, T]`.

    A sequence without explicit positions uses its key positions (its token indices); one with
    them uses what its calls gave (and implicit calls after them continue from the largest).
    """
    if all(seq.positions is None for seq, _ in work):
        return batch.positions if axes == 1 else batch.positions.unsqueeze(0).expand(axes, -1)
    parts = []
    for seq, n in work:
        start = seq.num_computed
        if seq.positions is None:
            parts.append(torch.arange(start, start + n).unsqueeze(0).expand(axes, -1))
        else:
            parts.append(seq.positions[:, start : start + n])
    pos = torch.cat(parts, dim=1).to(batch.positions.device)
    return pos[0] if axes == 1 else pos
