"""pi0's prefix mask in one call (a bidirectional prefix, then the state token seeing it and itself): the torch
backend runs a block-masked chunk as one unmasked SDPA per run of rows, equal to a dense forward under the mask."""

from __future__ import annotations

import pytest
import torch
from mstar_attn_torch import backend

from tests.engines.blocks_helpers import run_blocks
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
    earlier = list(range(1, before + 1))
    ids = [(7 * i) % 60 + 1 for i in range(n + 1)]
    if before == 0:  # frame_size n: rows 0..n-1 see the prefix, row n sees everything
        out = run(engine_for(module), "r", {"input_ids": ids}, frame_size=n)["hidden"]
        ref = dense(module, ids, mask=frame_mask(n + 1, n))
    else:  # a prefill that is not the sequence's first: keys come from the pages
        got = run_blocks(module, earlier, ids, [n, 1])
        out, ref = got.hidden, got.reference
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert [r for r in runs_taken if r is not None], "the block-masked chunk ran with a mask, not per run"
    runs = next(r for r in runs_taken if r is not None)
    assert [(lo, hi) for lo, hi, _ in runs] == [(0, n), (n, n + 1)]


def test_many_small_blocks_keep_the_mask(runs_taken):
    blocks = [3, 2, 4, 1, 5]  # fewer than 16 rows a run: one masked SDPA, not five calls
    got = run_blocks(TinyNode(), [], list(range(1, 16)), blocks)
    torch.testing.assert_close(got.hidden, got.reference, atol=1e-5, rtol=0)
    assert runs_taken and all(r is None for r in runs_taken)
