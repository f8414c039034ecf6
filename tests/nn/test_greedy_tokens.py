"""The greedy-token kernel (`argmax.cpp`, `mstar_core.nn.logits.greedy_tokens`) against torch's `max(-1).indices`."""

from __future__ import annotations

import pytest
import torch

from mstar_core.nn.logits import greedy_tokens

needs_kernel = pytest.mark.skipif(greedy_tokens(torch.zeros(1, 4)) is None, reason="no C++ compiler here")


def _rows(dtype: torch.dtype, rows: int, width: int, seed: int) -> torch.Tensor:
    """Random logits with the cases the index rule decides: ties, NaNs, infinities, a whole row at -inf, signed 0."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen).to(dtype)
    if rows > 1:
        x[1] = x[1].round()  # many ties at the maximum: the first wins
    if rows > 2:
        x[2, torch.randint(0, width, (2,), generator=gen)] = float("nan")  # the first NaN wins
    if rows > 3:
        x[3] = float("-inf")
    if rows > 4:
        x[4, -1] = float("inf")  # the maximum in the tail past the last 16 columns
    if rows > 5:
        x[5] = 0.0
        x[5, 0] = -0.0  # -0 equals +0: the first column
    if rows > 6:
        x[6, -1] = float("nan")  # a NaN in the tail only
    return x


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 7, 16, 33, 1000, 49152, 49157])
def test_each_rows_index_is_torchs(dtype, width):
    for seed in range(3):
        x = _rows(dtype, 8, width, seed)
        assert torch.equal(greedy_tokens(x), x.float().max(-1).indices)


@needs_kernel
def test_many_rows_and_row_strides():
    x = _rows(torch.bfloat16, 40, 49152, 7)  # (enough for the rows to split across threads)
    assert torch.equal(greedy_tokens(x), x.float().max(-1).indices)
    wide = _rows(torch.float32, 8, 1040, 8)
    view = wide[:, :1000]  # rows 1040 apart
    assert torch.equal(greedy_tokens(view), view.max(-1).indices)


def test_what_it_does_not_take_is_left_to_torch():
    assert greedy_tokens(torch.zeros(2, 8, dtype=torch.float16)) is None
    assert greedy_tokens(torch.zeros(8)) is None
    assert greedy_tokens(torch.zeros(8, 2).t()) is None  # columns not adjacent
    assert greedy_tokens(torch.zeros(2, 0)) is None
