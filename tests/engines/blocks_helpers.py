"""Block-masked calls (kvcache option `blocks`) against the dense reference: the setup the engine's and pi0's tests share."""

from __future__ import annotations

import attrs
import torch

from tests.engines.paged_tiny import dense, engine_for, run


def block_mask(prefix: int, blocks: list[int]) -> torch.Tensor:
    """Dense mask: a causal prefix, then blocks that each see the prefix, every earlier block and all of themselves."""
    n = prefix + sum(blocks)
    mask = torch.ones(n, n).tril().bool()
    start = prefix
    for size in blocks:
        mask[start : start + size, : start + size] = True
        start += size
    return mask


@attrs.frozen
class BlockRun:
    """One block-masked call on a fresh engine, and what a dense forward under the same mask gives."""

    engine: object
    hidden: torch.Tensor  # the call's rows
    reference: torch.Tensor  # the dense forward's rows for the same tokens
    pages_before: int  # pages in use before the call (after the prefix)


def run_blocks(module, prefix: list[int], ids: list[int], blocks: list[int], **options) -> BlockRun:
    """`prefix` (if any) as an earlier causal call, then `ids` in one call with `blocks` (and `options`)."""
    engine = engine_for(module)
    if prefix:  # keys of earlier tokens then come from the pages
        run(engine, "r", {"input_ids": prefix})
    pages = engine.pool.num_used
    out = run(engine, "r", {"input_ids": ids}, blocks=blocks, **options)
    reference = dense(module, prefix + ids, mask=block_mask(len(prefix), blocks))[len(prefix):]
    return BlockRun(engine, out["hidden"], reference, pages)
