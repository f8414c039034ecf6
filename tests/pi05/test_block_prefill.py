"""pi0's prefix mask in one call (a bidirectional prefix, then the state token seeing it and itself): the torch
backend runs a block-masked chunk as one unmasked SDPA per run of rows, equal to a dense forward under the mask."""

from __future__ import annotations

import pytest
import torch
from mstar_attn_torch import backend

from tests.engines.paged_tiny import TinyNode, dense, engine_for, run


def frame_mask(n: int, frame: int, before: int = 0) -> torch.Tensor:
    """Dense mask of `before` causal tokens then `n` frame-causal ones (each sees up to the end of its frame)."""
    total = before + n
    mask = torch.ones(total, total).tril().bool()
    for p in range(before, total):
        mask[p, : min(total, (p // frame + 1) * frame)] = True
    return mask


@pytest.fixture
def runs_taken(monkeypatch):
    taken = []

    def spy(bound):
        got = block_runs(bound)
        taken.append(got)
        return got

    block_runs = backend._block_runs
    monkeypatch.setattr(backend, "_block_runs", spy)
    return taken


@pytest.mark.parametrize("before", [0, 6])
def test_prefix_and_state_token_in_one_call_equal_the_dense_masked_forward(runs_taken, before):
    module, n = TinyNode(), 40
    engine = engine_for(module)
    earlier = list(range(1, before + 1))
    if earlier:  # a prefill that is not the sequence's first: keys come from the pages
        run(engine, "r", {"input_ids": earlier})
    ids = [(7 * i) % 60 + 1 for i in range(n + 1)]
    # frame_size n from token `before` on: with before=0, rows 0..n-1 see the prefix, row n sees everything
    out = run(engine, "r", {"input_ids": ids}, frame_size=n) if before == 0 else \
        run(engine, "r", {"input_ids": ids}, blocks=[n, 1])
    mask = frame_mask(n + 1, n) if before == 0 else _blocks_after(before, [n, 1])
    ref = dense(module, earlier + ids, mask=mask)[before:]
    torch.testing.assert_close(out["hidden"], ref, atol=1e-5, rtol=0)
    assert [r for r in runs_taken if r is not None], "the block-masked chunk ran with a mask, not per run"
    runs = next(r for r in runs_taken if r is not None)
    assert [(lo, hi) for lo, hi, _ in runs] == [(0, n), (n, n + 1)]


def test_many_small_blocks_keep_the_mask(runs_taken):
    module = TinyNode()
    engine = engine_for(module)
    blocks = [3, 2, 4, 1, 5]  # fewer than 16 rows a run: one masked SDPA, not five calls
    ids = list(range(1, 16))
    out = run(engine, "r", {"input_ids": ids}, blocks=blocks)
    torch.testing.assert_close(out["hidden"], dense(module, ids, mask=_blocks_after(0, blocks)), atol=1e-5, rtol=0)
    assert runs_taken and all(r is None for r in runs_taken)


def _blocks_after(before: int, blocks: list[int]) -> torch.Tensor:
    n = before + sum(blocks)
    mask = torch.ones(n, n).tril().bool()
    start = before
    for size in blocks:
        mask[start : start + size, : start + size] = True
        start += size
    return mask
