"""Option `blocks`: one call's tokens split into several bidirectional blocks, causal across blocks (pi0's
state token then its action tokens), equal to a dense forward under the same mask."""

from __future__ import annotations

import pytest
import torch

from mstar_core.errors import RequestError
from mstar_core.runtime.engine import Invocation
from tests.engines.paged_tiny import TinyNode, dense, engine_for, run


def block_mask(prefix: int, blocks: list[int]) -> torch.Tensor:
    """Dense mask: a causal prefix, then blocks that each see the prefix, every earlier block and all of themselves."""
    n = prefix + sum(blocks)
    mask = torch.ones(n, n).tril().bool()
    start = prefix
    for size in blocks:
        mask[start : start + size, : start + size] = True
        start += size
    return mask


@pytest.mark.parametrize("blocks", [[2, 3, 1], [1, 5], [6], [1, 1, 1, 1, 1, 1]])
def test_blocks_equal_a_dense_forward_under_the_same_mask(blocks):
    module = TinyNode()
    engine = engine_for(module)
    prefix, suffix = [1, 2, 3, 4, 5], [20, 21, 22, 23, 24, 25]
    run(engine, "r", {"input_ids": prefix})
    out = run(engine, "r", {"input_ids": suffix}, blocks=blocks)
    ref = dense(module, prefix + suffix, mask=block_mask(len(prefix), blocks))
    torch.testing.assert_close(out["hidden"], ref[len(prefix):], atol=1e-5, rtol=0)
    if blocks != [1] * 6:  # a block of more than one token does differ from the causal forward
        assert (ref[len(prefix):] - dense(module, prefix + suffix)[len(prefix):]).abs().max() > 1e-4
    # the keys written under the block mask are what a later causal token reads
    after = run(engine, "r", {"input_ids": [30]})
    mask = torch.cat((torch.cat((block_mask(5, blocks), torch.zeros(11, 1, dtype=torch.bool)), 1),
                      torch.ones(1, 12, dtype=torch.bool)))
    torch.testing.assert_close(after["hidden"], dense(module, prefix + suffix + [30], mask=mask)[-1:], atol=1e-5,
                               rtol=0)


def test_read_only_call_with_blocks_takes_no_page_and_equals_dense():
    module = TinyNode()
    engine = engine_for(module)
    prefix, suffix, blocks = [1, 2, 3, 4, 5, 6, 7], [40, 41, 42, 43], [1, 3]
    run(engine, "r", {"input_ids": prefix})
    used = engine.pool.num_used
    out = run(engine, "r", {"input_ids": suffix}, write_cache=False, blocks=blocks)
    assert engine.pool.num_used == used
    ref = dense(module, prefix + suffix, mask=block_mask(len(prefix), blocks))
    torch.testing.assert_close(out["hidden"], ref[len(prefix):], atol=1e-5, rtol=0)


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
