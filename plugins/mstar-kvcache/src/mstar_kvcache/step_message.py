"""The step message: what rank 0 of a split `kvcache` node sends its followers before each forward.

A follower holds the same pages as rank 0 (same numbers, its own heads' keys and values), so a step
is fully described by the page ops rank 0 did since the last step (applied first, in order), the
packed-row layout (`PagedBatch`: page tables, slot mapping, lengths) and the module's inputs (ids,
RoPE positions, spliced embeddings, per-call tensors). Lists of ints ride in the JSON header;
tensors travel as raw broadcasts (`mstar_core.runtime.rank_steps`).

Page ops are `[name, *ints]`: `["copy", src, dst]` (copy-on-write: page `dst` gets `src`'s keys and
values in every layer) and `["forget", seq_id]` (the attention backend drops a sequence's state).
A new page op (host offload, say) is a new name here: recorded by rank 0 where it happens, applied
by `apply_page_ops` before the step's forward.

A cache that moves to another worker (per-walk placement) moves every rank's KV heads: before rank 0
gathers the label's rows of its pages from the group (`GATHER`) or hands each rank its heads of an
imported snapshot's rows (`SCATTER`), it sends the pages and the row count (`kv_message`).
"""

from __future__ import annotations

from typing import Any

import torch

from mstar_core.runtime.rank_steps import RankMessage
from mstar_kvcache.batch import PagedBatch

STEP, CALL, GATHER, SCATTER = "step", "call", "gather_kv", "scatter_kv"


def step_message(key: str, ops: list[list[Any]], ids: torch.Tensor | None, positions: torch.Tensor,
                 batch: PagedBatch, embeds: torch.Tensor | None,
                 kwargs: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The header and tensors of one step of engine `key`."""
    header = {
        "kind": STEP, "engine": key, "ops": ops,
        "q_lens": batch.q_lens, "kv_lens": batch.kv_lens, "page_lists": batch.page_lists,
        "seq_ids": batch.seq_ids, "readonly": batch.readonly, "row_starts": batch.row_starts,
        "context_pages": [[i, [[list(p), n] for p, n in segments]] for i, segments in batch.context_pages.items()],
        "kwargs": sorted(kwargs),
    }
    tensors = {"positions": positions, "batch.positions": batch.positions, "batch.slot_mapping": batch.slot_mapping,
               "batch.page_table": batch.page_table, "batch.q_start": batch.q_start}
    optional = {"ids": ids, "embeds": embeds, "batch.limits": batch.limits, "batch.write_rows": batch.write_rows}
    tensors.update({name: t for name, t in optional.items() if t is not None})
    tensors.update({f"context.{i}": slots for i, slots in batch.context_slots.items()})
    tensors.update({f"kw.{name}": value for name, value in kwargs.items()})
    return header, tensors


def read_step(msg: RankMessage, page_size: int, device: torch.device) -> tuple[
        torch.Tensor | None, torch.Tensor, PagedBatch, torch.Tensor | None, dict[str, torch.Tensor]]:
    """`(ids, positions, batch, embeds, kwargs)` of a step message, on `device`."""
    h = msg.header
    t = {name: value.to(device) for name, value in msg.tensors.items()}
    batch = PagedBatch(
        page_size=page_size, q_lens=h["q_lens"], kv_lens=h["kv_lens"], q_start=t["batch.q_start"],
        positions=t["batch.positions"], slot_mapping=t["batch.slot_mapping"], page_table=t["batch.page_table"],
        page_lists=h["page_lists"], limits=t.get("batch.limits"), seq_ids=h["seq_ids"],
        write_rows=t.get("batch.write_rows"), readonly=h["readonly"],
        context_slots={i: t[f"context.{i}"] for i in h["readonly"]},
        context_pages={i: [(list(p), n) for p, n in segments] for i, segments in h["context_pages"]},
        row_starts=h["row_starts"],
    )
    kwargs = {name: t[f"kw.{name}"] for name in h["kwargs"]}
    return t.get("ids"), t["positions"], batch, t.get("embeds"), kwargs


def call_message(key: str, ops: list[list[Any]], method: str,
                 x: torch.Tensor) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A module call with collectives outside the forward (`embed`, `compute_logits`, `compute_<name>`)."""
    return {"kind": CALL, "engine": key, "ops": ops, "method": method}, {"x": x}


def kv_message(key: str, ops: list[list[Any]], kind: str, pages: list[int], rows: int) -> dict[str, Any]:
    """The header of a cache move's collective (`GATHER` or `SCATTER`): the first `rows` token rows of `pages`."""
    return {"kind": kind, "engine": key, "ops": ops, "pages": list(pages), "rows": rows}


def apply_page_ops(kv: torch.Tensor, backend: Any, ops: list[list[Any]]) -> None:
    """Do rank 0's page ops on this rank's pool `kv` (`[layers, 2, pages, page_size, heads, dim]`), in order."""
    for op in ops:
        if op[0] == "copy":
            kv[:, :, op[2]] = kv[:, :, op[1]]
        elif op[0] == "forget":
            forget = getattr(backend, "forget", None)
            if forget is not None:
                forget(op[1])
        else:
            raise ValueError(f"unknown page op {op[0]!r} in a step message")
