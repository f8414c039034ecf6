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
    (`page * page_size + offset`) where token `t`'s key and value go. `limits` is None for plain
    causal attention; otherwise `limits[t]` is the exclusive bound on key positions token `t` sees
    (`position + 1` is causal, a block end makes a bidirectional block). `seq_ids[i]` identifies
    sequence `i` across steps (unique per sequence for the engine's lifetime), for backends that keep
    per-sequence state between steps.
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


def build_batch(work: list[tuple[Sequence, int]], page_size: int, device: torch.device) -> tuple[torch.Tensor, PagedBatch]:
    """Packed input ids `[T]` and the batch layout for `(sequence, tokens to run)` pairs."""
    starts = [seq.num_computed for seq, _ in work]
    q_lens = [n for _, n in work]
    ids: list[int] = []
    for (seq, n), start in zip(work, starts, strict=True):
        ids.extend(seq.tokens[start : start + n])
    page_lists = [seq.pages for seq, _ in work]
    width = max(len(p) for p in page_lists)
    page_table = torch.tensor([p + [0] * (width - len(p)) for p in page_lists], dtype=torch.long)
    lens = torch.tensor(q_lens, dtype=torch.long)
    q_start = torch.zeros(len(work) + 1, dtype=torch.long)
    torch.cumsum(lens, 0, out=q_start[1:])
    total = int(q_start[-1])
    row = torch.repeat_interleave(torch.arange(len(work)), lens)
    positions = torch.arange(total) - q_start[:-1][row] + torch.tensor(starts, dtype=torch.long)[row]
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
    )
    return torch.tensor(ids, dtype=torch.long, device=device), batch
