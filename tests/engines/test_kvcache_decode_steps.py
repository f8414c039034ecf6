"""Option decode_steps: one sampling call samples n tokens, each fed back, equal to n calls made one by one."""

from __future__ import annotations

import pytest
import torch

from mstar_core.errors import RequestError
from mstar_core.runtime.engine import Invocation
from tests.engines.paged_tiny import LM_NODE, TinyNode, dense, drain, engine_for, run

PROMPT = [3, 9, 14, 1, 22, 7]
GREEDY = {"temperature": 0.0, "max_tokens": 100}


def _one_by_one(engine, rid: str, prompt: list[int], n: int, sampling: dict, **options) -> list[int]:
    out = [run(engine, rid, {"input_ids": prompt, "sampling": sampling}, **options)["next_token"]]
    while len(out) < n:
        out.append(run(engine, rid, {"input_ids": [out[-1]], "sampling": sampling},
                       **{k: v for k, v in options.items() if k == "cache_label"})["next_token"])
    return out


def test_steps_equal_calls_one_by_one_and_the_dense_model():
    module = TinyNode()
    want = _one_by_one(engine_for(module, LM_NODE), "a", PROMPT, 5, GREEDY)
    engine = engine_for(module, LM_NODE)
    got = run(engine, "a", {"input_ids": PROMPT, "sampling": GREEDY}, decode_steps=5)
    assert got["next_token"] == want and got["finish_reason"] is None
    assert engine.seqs[("a", "main")].tokens == PROMPT + want[:-1]  # the last token is not fed back
    ref = dense(module, PROMPT + want[:-1])
    torch.testing.assert_close(got["hidden"], ref[-1], atol=1e-5, rtol=0)  # other outputs: the last token's
    # seeded sampling draws the same tokens as the same calls made one by one
    sampled = {"temperature": 1.0, "seed": 7, "max_tokens": 100}
    assert run(engine_for(module, LM_NODE), "s", {"input_ids": PROMPT, "sampling": sampled},
               decode_steps=6)["next_token"] == _one_by_one(engine_for(module, LM_NODE), "s", PROMPT, 6, sampled)


def test_a_scratch_label_reset_per_call_batched_beside_plain_decodes():
    module = TinyNode()
    engine = engine_for(module, LM_NODE, max_num_seqs=8)
    frames = {"x": [4, 5], "y": [8, 2, 6]}
    for rid, seed in frames.items():  # two requests' frames, and a plain decode of a third, in the same steps
        engine.add(Invocation(rid, "lm", {"input_ids": seed, "sampling": GREEDY},
                              {"cache_label": "frame", "reset": True, "decode_steps": 4}))
    engine.add(Invocation("z", "lm", {"input_ids": PROMPT, "sampling": GREEDY}, {}))
    got = drain(engine)
    assert engine.largest_batch == 3
    for rid, seed in frames.items():
        assert got[rid]["next_token"] == _one_by_one(engine_for(module, LM_NODE), rid, seed, 4, GREEDY)
    assert got["z"]["next_token"] == int(module.head(dense(module, PROMPT)[-1]).argmax())
    # the next frame starts over on the same label (a fresh scratch cache, its pages reused)
    again = run(engine, "x", {"input_ids": [9], "sampling": GREEDY}, cache_label="frame", reset=True, decode_steps=2)
    assert again["next_token"] == _one_by_one(engine_for(module, LM_NODE), "w", [9], 2, GREEDY)
    assert len(engine.seqs[("x", "frame")].tokens) == 2


def test_a_finish_reason_ends_the_steps_early():
    module = TinyNode()
    want = _one_by_one(engine_for(module, LM_NODE), "a", PROMPT, 4, GREEDY)
    stop = {**GREEDY, "stop_token_ids": [want[1]]}
    got = run(engine_for(module, LM_NODE), "a", {"input_ids": PROMPT, "sampling": stop}, decode_steps=4)
    assert got["next_token"] == want[:2] and got["finish_reason"] == "stop"
    short = run(engine_for(module, LM_NODE), "b", {"input_ids": PROMPT, "sampling": {**GREEDY, "max_tokens": 3}},
                decode_steps=10)
    assert short["next_token"] == want[:3] and short["finish_reason"] == "length"


@pytest.mark.parametrize(("inputs", "options"), [
    ({"input_ids": PROMPT, "sampling": GREEDY}, {"decode_steps": 0}),
    ({"input_ids": PROMPT, "sampling": GREEDY}, {"decode_steps": "3"}),
    ({"input_ids": PROMPT}, {"decode_steps": 2}),
    ({"input_ids": PROMPT, "sampling": GREEDY}, {"decode_steps": 2, "output_rows": "all"}),
])
def test_bad_decode_steps_fail_naming_the_option(inputs, options):
    engine = engine_for(TinyNode(), LM_NODE)
    with pytest.raises(RequestError, match="decode_steps"):
        run(engine, "a", inputs, **options)
