"""The next-token kernels (`next_token.cpp`): greedy tokens against torch's `max(-1).indices`, bit for bit; draws at a
temperature against the softmax they draw from and against the sampler's torch ops."""

from __future__ import annotations

import pytest
import torch

from mstar_core.nn.logits import drawn_tokens, greedy_tokens

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


@needs_kernel
@pytest.mark.parametrize("width", [5, 37, 1003])
def test_draws_follow_the_softmax_and_never_take_a_masked_column(width):
    gen = torch.Generator().manual_seed(width)
    row = torch.randn(1, width, generator=gen) * 2
    row[0, 1::3] = float("-inf")  # masked columns (a grammar, a bias of -inf): never drawn
    n = 16000
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    drawn = drawn_tokens(row.expand(n, width), [0.8] * n, u)  # (one row n times: rows 0 elements apart)
    counts = torch.bincount(drawn, minlength=width).double() / n
    want = torch.softmax(row[0].double() / 0.8, -1)
    assert counts[1::3].sum() == 0
    # the drawn columns' distribution is the softmax's (Kolmogorov-Smirnov over the column order, beyond p = 0.001)
    assert float((counts.cumsum(0) - want.cumsum(0)).abs().max()) < 1.95 / n**0.5
    # u just under 1: the last column of weight (never a masked one), as the sampler's torch ops take
    last = torch.tensor([1.0 - 2**-53], dtype=torch.float64)
    assert int(drawn_tokens(row, [0.8], last)) == max(i for i in range(width) if i % 3 != 1)


@needs_kernel
def test_draws_agree_with_the_sampler_torch_ops_but_at_rounding():
    from mstar_kvcache.sampler import draw_with, filtered

    from mstar_core.sampling import SamplingParams

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 49152, generator=gen) * 3
    u = torch.rand(500, generator=gen, dtype=torch.float64)
    params = [SamplingParams(temperature=0.7)]
    ours = [int(drawn_tokens(logits, [0.7], u[i : i + 1])) for i in range(500)]
    theirs = [int(draw_with(*filtered(logits, params, for_draw=True), u[i : i + 1])) for i in range(500)]
    assert sum(a == b for a, b in zip(ours, theirs, strict=True)) >= 490  # (exp within 2 ulp, sums in another order)


@needs_kernel
def test_a_row_without_a_finite_maximum_is_left_to_torch():
    rows = torch.zeros(4, 40)
    rows[1, 3] = float("nan")
    rows[2, 5] = float("inf")
    rows[3] = float("-inf")
    got = drawn_tokens(rows, [1.0] * 4, torch.full((4,), 0.5, dtype=torch.float64))
    assert got[0] == 20 and (got[1:] == -1).all()  # (a flat row: u 0.5 lands mid-vocabulary)
    assert drawn_tokens(rows.bfloat16(), [1.0] * 4, torch.full((4,), 0.5, dtype=torch.float64)) is None
