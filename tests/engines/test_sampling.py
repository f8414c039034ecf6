"""Sampling: parameter validation, filters against transformers' processors, seeds, stops, logprobs."""

from __future__ import annotations

import pytest
import torch
from mstar_kvcache.sampler import _filtered_probs, apply_repetition_penalty, sample

from mstar_core.errors import RequestError
from mstar_core.sampling import SamplingParams
from tests.engines.driver import generate, make_engine


@pytest.mark.parametrize(
    "bad", [{"temperature": -1}, {"top_p": 0}, {"min_p": 1.0}, {"max_tokens": 0}, {"stop_sequences": [[]]}, {"nope": 1}]
)
def test_bad_params_name_the_field(bad):
    with pytest.raises(RequestError) as err:
        SamplingParams.from_mapping(bad)
    assert next(iter(bad)) in str(err.value)


def test_filters_match_transformers_processors():
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    history = [[1, 2, 2, 7], [0], [49, 3]]
    ours = logits.clone()
    apply_repetition_penalty(ours, history, [1.3, 1.3, 1.3])
    for row, seen in enumerate(history):
        ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([seen]), logits[row : row + 1].clone())
        torch.testing.assert_close(ours[row : row + 1], ref)
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.8, min_p=0.05)
    probs, order = _filtered_probs(logits, [params] * 3)
    ids = torch.zeros(3, 1, dtype=torch.long)
    ref = TemperatureLogitsWarper(0.7)(ids, logits.clone())
    for warp in (TopKLogitsWarper(10), TopPLogitsWarper(0.8), MinPLogitsWarper(0.05)):
        ref = warp(ids, ref)
    expected = ref.softmax(-1).gather(1, order)
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-5)


def test_logprobs_and_top_logprobs():
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(3))
    out = sample(logits, [SamplingParams(logprobs=3), None], [None, None], [[], []])
    ref = torch.log_softmax(logits, -1)
    assert out.tokens == logits.argmax(-1).tolist()
    assert out.logprobs == pytest.approx(ref.max(-1).values.tolist(), abs=1e-6)
    assert [t for t, _ in out.top_logprobs[0]] == ref[0].topk(3).indices.tolist()
    assert out.top_logprobs[1] is None


def test_seed_gives_same_tokens_whatever_the_batch(llama_pair):
    _, ours = llama_pair
    seeded = {"sampling": SamplingParams(temperature=1.0, top_p=0.95, seed=1234)}
    alone = generate(make_engine(ours, num_pages=64), {"x": [1, 2, 3]}, 20, inputs={"x": seeded})
    crowd_prompts = {"a": [9, 9], "x": [1, 2, 3], "b": list(range(30))}
    crowd_inputs = {"x": seeded, "a": {"sampling": SamplingParams(temperature=1.5, seed=7)}}
    crowd = generate(make_engine(ours, num_pages=64), crowd_prompts, 20, inputs=crowd_inputs)
    assert alone["x"] == crowd["x"]
    other = generate(make_engine(ours, num_pages=64), {"x": [1, 2, 3]}, 20,
                     inputs={"x": {"sampling": SamplingParams(temperature=1.0, top_p=0.95, seed=99)}})
    assert other["x"] != alone["x"]


def test_stop_tokens_sequences_and_max_tokens(llama_pair):
    _, ours = llama_pair
    greedy = generate(make_engine(ours), {"r": [4, 5, 6]}, 12)["r"]
    engine = make_engine(ours)
    cases = {
        "tok": SamplingParams(stop_token_ids=[greedy[5]]),
        "seq": SamplingParams(stop_sequences=[greedy[3:5]]),
        "len": SamplingParams(max_tokens=4),
    }
    reasons = {}
    for rid, params in cases.items():
        out = generate(engine, {rid: [4, 5, 6]}, 50, inputs={rid: {"sampling": params}}, release=False)
        got = out[rid]
        reasons[rid] = len(got)
        engine.release(rid)
    first_stop = greedy.index(greedy[5]) + 1
    assert reasons == {"tok": first_stop, "seq": 5, "len": 4}
    assert engine.pool.num_used == 0
