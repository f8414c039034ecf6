"""`RotaryEmbedding`'s CPU tables: rows read from a table computed once equal the rows computed per call, bit for bit."""

from __future__ import annotations

import pytest
import torch

from mstar_core.nn import rotary
from mstar_core.nn.rotary import RotaryEmbedding

ROPES = [(64, {"rope_type": "default", "rope_theta": 100000.0}),
         (128, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
         (80, {"rope_type": "default", "partial_rotary_factor": 0.5}),  # 40 rotary dims: a vector tail
         (36, None)]


@pytest.mark.parametrize(("head_dim", "params"), ROPES)
def test_table_rows_are_the_computed_rows(head_dim, params):
    rope = RotaryEmbedding(head_dim, params)
    for positions in ([0], [7], [1023], [1024], [5000], list(range(3, 40)), [9, 2, 9, 4000], []):
        at = torch.tensor(positions, dtype=torch.long)
        got, want = rope(at), rope._tables_at(at)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert rope._table is not None and rope._table[0].shape[0] == 8192  # grown by doubling to cover 5000


def test_what_the_table_does_not_hold_is_computed(monkeypatch):
    monkeypatch.setattr(rotary, "MAX_TABLE_ROWS", 64)
    rope = RotaryEmbedding(64)
    for positions in ([3], [-2, 5], [70], [10, 500]):
        at = torch.tensor(positions)
        got, want = rope(at), rope._tables_at(at)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert rope._table is None or rope._table[0].shape[0] <= 64
    floats = torch.tensor([1.5, 2.0])  # (not int64 ids: computed as before)
    assert torch.equal(rope(floats)[0], rope._tables_at(floats)[0])


def test_a_table_made_in_inference_mode_serves_autograd_code_too():
    rope = RotaryEmbedding(64)
    with torch.inference_mode():
        rope(torch.tensor([3]))
    x = torch.ones(1, 64, requires_grad=True)
    cos, _ = rope(torch.tensor([2]))
    (x * cos).sum().backward()
    assert torch.equal(x.grad, cos)
