"""`PagedBatch`: the row starts and page table a step's batch makes when first read, and those given to it."""

from __future__ import annotations

import torch
from mstar_kvcache.batch import PagedBatch, build_batch
from mstar_kvcache.sequence import Sequence


def test_row_starts_and_page_table_are_made_when_first_read():
    work = []
    for i, (done, new, pages) in enumerate([(5, 1, [7, 3]), (0, 3, [9]), (8, 1, [1, 4, 6])]):
        seq = Sequence(f"r{i}", "main", tokens=[1] * (done + new), num_computed=done, order=i)
        seq.pages = pages
        work.append((seq, new))
    _, batch = build_batch(work, 4, torch.device("cpu"))
    assert batch._q_start is None and batch._page_table is None  # (a lane step reads neither)
    assert batch.q_start.tolist() == [0, 1, 4, 5]
    assert batch.page_table.tolist() == [[7, 3, 0], [9, 0, 0], [1, 4, 6]]
    assert batch.page_table is batch.page_table  # made once
    given = PagedBatch(page_size=4, q_lens=[2], kv_lens=[2], q_start=torch.tensor([0, 2]), positions=torch.arange(2),
                       slot_mapping=torch.arange(2), page_table=torch.tensor([[5]]), page_lists=[[5]])
    assert given.q_start.tolist() == [0, 2] and given.page_table.tolist() == [[5]]
    made = PagedBatch(page_size=4, q_lens=[2, 1], kv_lens=[2, 1], positions=torch.arange(3),
                      slot_mapping=torch.arange(3), page_lists=[[], [2]])
    assert made.q_start.tolist() == [0, 2, 3] and made.page_table.tolist() == [[0], [2]]
