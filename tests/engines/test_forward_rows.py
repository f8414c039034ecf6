"""Steps whose answers read only their sampled rows run the last layer past its attention on those rows alone
(`forward_rows`): the same logits, bit for bit, as steps that run every row through it."""

from __future__ import annotations

import copy

import pytest
import torch

from mstar_core.runtime.engine import Invocation
from tests.engines.driver import make_engine

PROMPTS = {"a": list(range(1, 30)), "b": [5, 9, 2, 7, 7, 3, 1], "c": list(range(40, 85))}
STEPS = 6


def _run(model, forward_rows: bool):
    """Greedy continuations, every answer's logits, and the rows each eager step's last MLP ran over."""
    engine = make_engine(model, num_pages=256, page_size=4, max_num_batched_tokens=64, prefill_step_tokens=16)
    engine.forward.forward_rows = forward_rows
    mlp = model.model.layers[-1].mlp
    mlp_rows: list[int] = []
    plain = type(mlp).forward

    def counting(h):
        mlp_rows.append(h.shape[0])
        return plain(mlp, h)

    mlp.forward = counting  # (an attribute, not a hook: hooks take the per-layer path)
    tokens = {rid: [] for rid in PROMPTS}
    logits = []
    engine.add(Invocation("a", "lm", {"input_ids": PROMPTS["a"]}, {}))
    while engine.has_work():
        for inv, res in engine.step():
            assert not isinstance(res, BaseException), res
            tokens[inv.request_id].append(res["next_token"])
            logits.append(res["logits"].float())
            if len(tokens[inv.request_id]) < STEPS:
                engine.add(Invocation(inv.request_id, "lm", {"input_ids": res["next_token"]}, {}))
            else:
                engine.release(inv.request_id)
            if inv.request_id == "a" and len(tokens["a"]) == 2:  # prompts arriving beside a decode row
                for rid in ("b", "c"):
                    engine.add(Invocation(rid, "lm", {"input_ids": PROMPTS[rid]}, {}))
    assert engine.pool.num_used == 0
    return tokens, logits, mlp_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_rows_answer_the_same_logits_bit_for_bit(llama_pair, dtype):
    _, ours = llama_pair
    model = copy.deepcopy(ours).to(dtype)
    tokens, logits, kept = _run(copy.deepcopy(model), True)
    ref_tokens, ref_logits, every = _run(copy.deepcopy(model), False)
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits) == STEPS * len(PROMPTS)
    assert torch.equal(torch.stack(logits), torch.stack(ref_logits))
    # the prompt steps ran the last MLP over their sampled rows (a chunk that ends no prompt: one row)
    assert len(kept) == len(every) and sum(kept) < sum(every)
    assert kept[0] == 1 and every[0] == len(PROMPTS["a"])  # "a"'s prompt step samples its last row alone
    assert all(k <= e for k, e in zip(kept, every, strict=True))
    # prompt chunks beside a decode row: the decode row and any prompt the chunk ends go on, the chunk's others not
    assert any(e >= 17 and k <= 3 for k, e in zip(kept, every, strict=True))


def test_a_hooked_model_gives_the_kept_rows_too(llama_pair):
    """With a forward hook the layers run one call each (the hook sees them); the rows asked for still come out."""
    _, ours = llama_pair
    model = copy.deepcopy(ours)
    seen = []
    model.model.norm.register_forward_hook(lambda module, args, out: seen.append(out.shape[0]))
    tokens, logits, _ = _run(model, True)
    ref_tokens, ref_logits, _ = _run(copy.deepcopy(ours), False)
    assert tokens == ref_tokens and torch.equal(torch.stack(logits), torch.stack(ref_logits))
    assert seen and seen[0] == len(PROMPTS["a"])  # the final norm ran over every row, then the kept ones were taken


def test_steps_that_read_other_rows_run_every_row(llama_pair):
    """A node that returns hidden states reads every row: no rows are named to the module."""
    from mstar_kvcache.answers import CallAnswers

    _, ours = llama_pair
    engine = make_engine(copy.deepcopy(ours), num_pages=64, page_size=4)
    named = []
    expect = engine.forward.expect
    engine.forward.expect = lambda keep, greedy, rows=None: named.append(rows) or expect(keep, greedy, rows)
    engine.answers.returns_hidden = True
    assert isinstance(engine.answers, CallAnswers)
    engine.add(Invocation("x", "lm", {"input_ids": list(range(1, 12))}, {}))
    while engine.has_work():
        for inv, res in engine.step():
            assert not isinstance(res, BaseException), res
            engine.release(inv.request_id)
    assert named == [None]
