"""Option `blocks`: one call's tokens split into several bidirectional blocks, causal across blocks (pi0's
state token then its action tokens), equal to a dense forward under the same mask."""

from __future__ import annotations

import pytest
import torch

from mstar_core.errors import RequestError
from mstar_core.runtime.engine import Invocation
from tests.engines.blocks_helpers import block_mask, run_blocks
from tests.engines.paged_tiny import TinyNode, dense, engine_for, run


@pytest.mark.parametrize("blocks", [[2, 3, 1], [1, 5], [6], [1, 1, 1, 1, 1, 1]])
def test_blocks_equal_a_dense_forward_under_the_same_mask(blocks):
    module = TinyNode()
    prefix, suffix = [1, 2, 3, 4, 5], [20, 21, 22, 23, 24, 25]
    got = run_blocks(module, prefix, suffix, blocks)
    torch.testing.assert_close(got.hidden, got.reference, atol=1e-5, rtol=0)
    if blocks != [1] * 6:  # a block of more than one token does differ from the causal forward
        assert (got.reference - dense(module, prefix + suffix)[len(prefix):]).abs().max() > 1e-4
    # the keys written under the block mask are what a later causal token reads
    after = run(got.engine, "r", {"input_ids": [30]})
    mask = torch.cat((torch.cat((block_mask(5, blocks), torch.zeros(11, 1, dtype=torch.bool)), 1),
                      torch.ones(1, 12, dtype=torch.bool)))
    torch.testing.assert_close(after["hidden"], dense(module, prefix + suffix + [30], mask=mask)[-1:], atol=1e-5,
                               rtol=0)


def test_read_only_call_with_blocks_takes_no_page_and_equals_dense():
    got = run_blocks(TinyNode(), [1, 2, 3, 4, 5, 6, 7], [40, 41, 42, 43], [1, 3], write_cache=False)
    assert got.engine.pool.num_used == got.pages_before > 0
    torch.testing.assert_close(got.hidden, got.reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("options", "match"), [
    ({"blocks": [2, 2]}, "summing to the call's 5 tokens"),
    ({"blocks": [5, 0]}, "positive block lengths"),
    ({"blocks": "5"}, "positive block lengths"),
    ({"blocks": [5], "bidirectional": True}, "exclusive"),
    ({"blocks": [5], "frame_size": 2}, "exclusive"),
])
def test_bad_blocks_fail_the_call_naming_the_option(options, match):
    engine = engine_for(TinyNode())
    engine.add(Invocation("r", "dit", {"input_ids": [1, 2, 3, 4, 5]}, options))
    (_, res), = engine.step()
    assert isinstance(res, RequestError) and "blocks" in str(res) and match in str(res)
    assert engine.pool.num_used == 0
