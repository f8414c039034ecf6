"""A sampling call that asks for per-token outputs gets them beside its sample, equal to a per-token call's."""

from __future__ import annotations

import pytest
import torch

from mstar_core.graph import GraphNode
from mstar_core.runtime.engine import Invocation
from tests.engines.paged_tiny import ROW_NODE, TinyNode, dense, drain, engine_for, run

PROMPT = [3, 9, 14, 1, 22, 7, 30, 5, 11, 2, 40, 17, 8]  # 13 tokens: chunked over several steps below
#: an LM that also declares a module output (velocity) and takes output_index
LM_ROWS = GraphNode("lm", inputs=("input_ids",), optional_inputs=("sampling", "output_index"),
                    outputs=("next_token", "finish_reason", "hidden", "velocity"), engine="kvcache")
GREEDY = {"temperature": 0.0, "max_tokens": 8}


def _lm(module, **settings):
    return engine_for(module, LM_ROWS, max_num_batched_tokens=5, **settings)  # the prompt spans three steps


def test_sampling_call_rows_equal_per_token_call_and_dense():
    module = TinyNode()
    out = run(_lm(module), "a", {"input_ids": PROMPT, "sampling": GREEDY}, output_rows="all")
    rows = run(engine_for(module), "a", {"input_ids": PROMPT})  # the same call on a per-token node
    ref = dense(module, PROMPT)
    assert out["velocity"].shape == (len(PROMPT), 4)
    torch.testing.assert_close(out["velocity"], rows["velocity"], atol=1e-5, rtol=0)
    torch.testing.assert_close(out["velocity"], module.vel(ref), atol=1e-5, rtol=0)
    assert out["next_token"] == int(module.head(ref[-1]).argmax())  # the sample is unchanged
    torch.testing.assert_close(out["hidden"], ref[-1], atol=1e-5, rtol=0)  # `hidden` stays the last row


def test_rows_only_when_asked_and_narrowed_like_per_token_calls():
    module = TinyNode()
    engine = _lm(module)
    plain = run(engine, "a", {"input_ids": PROMPT, "sampling": GREEDY})
    assert "velocity" not in plain  # a decode step pays nothing for outputs it did not ask for
    step = run(engine, "a", {"input_ids": [plain["next_token"]], "sampling": GREEDY})
    assert "velocity" not in step
    ref = module.vel(dense(module, PROMPT))
    last = run(_lm(module), "b", {"input_ids": PROMPT, "sampling": GREEDY}, output_rows="last")
    torch.testing.assert_close(last["velocity"], ref[-1:], atol=1e-5, rtol=0)
    index = torch.tensor([0, 4, 12])
    picked = run(_lm(module), "c", {"input_ids": PROMPT, "sampling": GREEDY, "output_index": index})
    torch.testing.assert_close(picked["velocity"], ref[index], atol=1e-5, rtol=0)


def test_batched_with_a_call_that_did_not_ask_and_after_a_decode():
    module = TinyNode()
    engine = _lm(module, max_num_seqs=4)
    run(engine, "x", {"input_ids": PROMPT[:4], "sampling": GREEDY})
    engine.add(Invocation("x", "lm", {"input_ids": [5], "sampling": GREEDY}, {}))  # decode beside the prefill
    engine.add(Invocation("y", "lm", {"input_ids": PROMPT, "sampling": GREEDY}, {"output_rows": "all"}))
    got = drain(engine)
    assert "velocity" not in got["x"]
    torch.testing.assert_close(got["y"]["velocity"], module.vel(dense(module, PROMPT)), atol=1e-5, rtol=0)
    # a later call of the same label: its own rows, after the cached ones
    more = run(engine, "y", {"input_ids": [got["y"]["next_token"], 6], "sampling": GREEDY}, output_rows="all")
    full = module.vel(dense(module, [*PROMPT, got["y"]["next_token"], 6]))
    torch.testing.assert_close(more["velocity"], full[-2:], atol=1e-5, rtol=0)


def test_a_failing_output_fails_only_the_call_that_asked():
    class Broken(TinyNode):
        def compute_velocity(self, hidden):
            raise ValueError("velocity broke")

    engine = _lm(Broken(), max_num_seqs=4)
    engine.add(Invocation("ok", "lm", {"input_ids": PROMPT[:3], "sampling": GREEDY}, {}))
    engine.add(Invocation("bad", "lm", {"input_ids": PROMPT[:2], "sampling": GREEDY}, {"output_rows": "all"}))
    results = {}
    while engine.has_work():
        results.update({inv.request_id: res for inv, res in engine.step()})
    assert isinstance(results["bad"], ValueError) and isinstance(results["ok"]["next_token"], int)
    assert engine.seqs["bad", "main"].tokens == []  # the failed call's tokens were rolled back


def test_output_rows_checked():
    from mstar_core.errors import RequestError

    engine = _lm(TinyNode())
    engine.add(Invocation("a", "lm", {"input_ids": PROMPT, "sampling": GREEDY}, {"output_rows": "first"}))
    with pytest.raises(RequestError, match="output_rows"):
        drain(engine)


def test_a_prefix_hit_never_skips_rows_a_call_returns():
    module = TinyNode()
    engine = engine_for(module, ROW_NODE)
    run(engine, "a", {"input_ids": PROMPT})
    engine.release("a")
    hits = engine.pool.hits
    tail = run(engine, "c", {"input_ids": PROMPT, "output_index": torch.tensor([9, 12])})  # pages before row 9 reused
    assert engine.pool.hits - hits == 9 // engine.pool.page_size
    torch.testing.assert_close(tail["hidden"], dense(module, PROMPT)[[9, 12]], atol=1e-5, rtol=0)
    lm = _lm(module)
    run(lm, "a", {"input_ids": PROMPT, "sampling": GREEDY})
    lm.release("a")
    hits = lm.pool.hits
    out = run(lm, "b", {"input_ids": PROMPT, "sampling": GREEDY}, output_rows="all")  # every row computed again
    assert lm.pool.hits == hits
    torch.testing.assert_close(out["velocity"], module.vel(dense(module, PROMPT)), atol=1e-5, rtol=0)
