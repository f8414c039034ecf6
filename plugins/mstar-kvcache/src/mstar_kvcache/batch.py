"""`PagedBatch`: one step's packed-token layout over the page tables, built once and shared by every layer."""

from __future__ import annotations

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
    q_start: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    page_table: torch.Tensor
    page_lists: list[list[int]]
    limits: torch.Tensor | None = None
    seq_ids: list[int] | None = None
    write_rows: torch.Tensor | None = None
    readonly: list[int] = attrs.field(factory=list)
    context_slots: dict[int, torch.Tensor] = attrs.field(factory=dict)
    context_pages: dict[int, list[tuple[list[int], int]]] = attrs.field(factory=dict)

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


def context_slots(context: list[tuple[list[int], int]], page_size: int) -> torch.Tensor:
    """Flat slots of frozen keys: each `(pages, length)` segment's first `length` keys, in order."""
    parts = []
    for pages, length in context:
        pos = torch.arange(length)
        parts.append(torch.tensor(pages, dtype=torch.long)[pos // page_size] * page_size + pos % page_size)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def build_batch(work: list[tuple[Sequence, int]], page_size: int, device: torch.device) -> tuple[torch.Tensor, PagedBatch]:
    """Packed input ids `[T]` and the batch layout for `(sequence, tokens to run)` pairs."""
    starts = [seq.num_computed for seq, _ in work]
    q_lens = [n for _, n in work]
    ids: list[int] = []
    for (seq, n), start in zip(work, starts, strict=True):
        ids.extend(seq.tokens[start : start + n])
    page_lists = [seq.pages for seq, _ in work]
    width = max(1, max(len(p) for p in page_lists))
    page_table = torch.tensor([p + [0] * (width - len(p)) for p in page_lists], dtype=torch.long)
    lens = torch.tensor(q_lens, dtype=torch.long)
    q_start = torch.zeros(len(work) + 1, dtype=torch.long)
    torch.cumsum(lens, 0, out=q_start[1:])
    total = int(q_start[-1])
    row = torch.repeat_interleave(torch.arange(len(work)), lens)
    positions = torch.arange(total) - q_start[:-1][row] + torch.tensor(starts, dtype=torch.long)[row]
    readonly = [i for i, (seq, _) in enumerate(work) if seq.readonly]
    write_rows = None
    if readonly:
        writes = torch.tensor([not seq.readonly for seq, _ in work])[row]
        write_rows = writes.nonzero().flatten()
        wrow, wpos = row[write_rows], positions[write_rows]
        slots = page_table[wrow, wpos // page_size] * page_size + wpos % page_size
    else:
        slots = page_table[row, positions // page_size] * page_size + positions % page_size
    limits = None
    if any(seq.limits is not None for seq, _ in work):
        parts = []
        for (seq, n), start in zip(work, starts, strict=True):
            if seq.limits is None:
                parts.append(torch.arange(start + 1, start + n + 1))
            else:
                parts.append(torch.tensor(seq.limits[start : start + n], dtype=torch.long))
        limits = torch.cat(parts).to(device)
    batch = PagedBatch(
        page_size=page_size,
        q_lens=q_lens,
        kv_lens=[s + n for s, n in zip(starts, q_lens, strict=True)],
        q_start=q_start.to(device),
        positions=positions.to(device),
        slot_mapping=slots.to(device),
        page_table=page_table.to(device),
        page_lists=[list(p) for p in page_lists],
        limits=limits,
        seq_ids=[seq.order for seq, _ in work],
        write_rows=None if write_rows is None else write_rows.to(device),
        readonly=readonly,
        context_slots={i: context_slots(work[i][0].context, page_size).to(device) for i in readonly},
        context_pages={i: [(list(p), n) for p, n in work[i][0].context] for i in readonly},
    )
    return torch.tensor(ids, dtype=torch.long, device=device), batch


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
