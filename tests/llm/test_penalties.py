"""Logit adjustments of the kvcache sampler against references on the same logits: transformers'
`RepetitionPenaltyLogitsProcessor`, OpenAI's presence/frequency formula computed by hand, and logit bias."""

from __future__ import annotations

import pytest
import torch

from mstar_core.errors import RequestError
from mstar_core.sampling import SamplingParams

sampler = pytest.importorskip("mstar_kvcache.sampler")
transformers = pytest.importorskip("transformers")

VOCAB = 97


def _logits(rows: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _reference_presence_frequency(logits: torch.Tensor, generated: list[list[int]], presence: float,
                                  frequency: float) -> torch.Tensor:
    """OpenAI's formula, one token at a time: mu[j] - c[j] * frequency - (c[j] > 0) * presence."""
    out = logits.clone()
    for row, ids in enumerate(generated):
        for token in set(ids):
            count = ids.count(token)
            out[row, token] -= count * frequency + (count > 0) * presence
    return out


def test_repetition_penalty_equals_transformers_processor():
    logits = _logits()
    history = [[3, 5, 5, 90], [0, 1, 2, 3, 4, 96], [7], [11, 12, 13, 11]]
    for penalty in (1.3, 0.7):
        want = logits.clone()
        for row, ids in enumerate(history):  # transformers takes equal-length rows; one row at a time
            processor = transformers.RepetitionPenaltyLogitsProcessor(penalty)
            want[row] = processor(torch.tensor([ids]), logits[row : row + 1].clone())[0]
        params = [SamplingParams(repetition_penalty=penalty)] * len(history)
        got = sampler.adjust_logits(logits, params, history, [[] for _ in history])
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # rows without a penalty are left alone in a mixed batch
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(), SamplingParams(repetition_penalty=1.3),
              SamplingParams()]
    got = sampler.adjust_logits(logits, params, history, [[] for _ in history])
    torch.testing.assert_close(got[1], logits[1], rtol=0, atol=0)
    torch.testing.assert_close(got[3], logits[3], rtol=0, atol=0)


@pytest.mark.parametrize(("presence", "frequency"), [(0.5, 0.0), (0.0, 0.75), (1.5, -0.4), (-2.0, 2.0)])
def test_presence_and_frequency_follow_openais_formula(presence, frequency):
    logits = _logits(seed=1)
    generated = [[3, 5, 5, 90, 5], [], [7], [11, 12, 13, 11, 11, 11]]
    history = [[1, 2, *g] for g in generated]  # the prompt ids (1, 2) are not counted, only generated ones
    params = [SamplingParams(presence_penalty=presence, frequency_penalty=frequency)] * 4
    got = sampler.adjust_logits(logits, params, history, generated)
    torch.testing.assert_close(got, _reference_presence_frequency(logits, generated, presence, frequency))
    assert torch.equal(got[:, 1], logits[:, 1]) and torch.equal(got[:, 2], logits[:, 2])


def test_logit_bias_and_the_order_of_adjustments():
    logits = _logits(seed=2)
    history = [[4, 4, 9], [8]]
    generated = [[4, 9], [8]]
    params = [SamplingParams(logit_bias={"4": 2.5, "60": -100}, repetition_penalty=1.2, presence_penalty=0.3,
                             frequency_penalty=0.1), SamplingParams()]
    got = sampler.adjust_logits(logits[:2], params, history, generated)
    want = logits[:2].clone()
    want[0, 4] += 2.5
    want[0, 60] -= 100
    want[0:1] = transformers.RepetitionPenaltyLogitsProcessor(1.2)(torch.tensor([history[0]]), want[0:1])
    want[0:1] = _reference_presence_frequency(want[0:1], generated[:1], 0.3, 0.1)
    torch.testing.assert_close(got, want)
    assert torch.equal(got[1], logits[1])


def test_no_adjustment_is_free_and_logprobs_stay_the_models():
    logits = _logits(seed=3)
    params = [SamplingParams()] * 4
    assert sampler.adjust_logits(logits, params, [[1]] * 4, [[1]] * 4) is logits  # no copy, no work
    # a bias forces the token, the reported log-probability is still the model's
    forced = [SamplingParams(logit_bias={"5": 100}, logprobs=2)] * 4
    out = sampler.sample(logits, forced, [None] * 4, [[0]] * 4, generated=[[]] * 4)
    assert out.tokens == [5] * 4
    want = logits.log_softmax(-1)
    for row in range(4):
        assert abs(out.logprobs[row] - want[row, 5].item()) < 1e-5
        assert [t for t, _ in out.top_logprobs[row]] == want[row].topk(2).indices.tolist()


def test_a_strong_presence_penalty_changes_the_greedy_pick():
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 1.0
    logits[0, 8] = 0.9
    params = [SamplingParams(presence_penalty=0.5)]
    assert sampler.sample(logits, params, [None], [[7]], generated=[[7]]).tokens == [8]
    assert sampler.sample(logits, params, [None], [[7]], generated=[[]]).tokens == [7]  # 7 only in the prompt


@pytest.mark.parametrize(("field", "value"), [
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("frequency_penalty", float("nan")),
    ("frequency_penalty", "1"), ("logit_bias", {"5": 101}), ("logit_bias", {"x": 1}), ("logit_bias", [3]),
    ("logit_bias", {"5": True}), ("logit_bias", {"-1": 0}),
])
def test_bounds_name_the_field(field, value):
    with pytest.raises(RequestError) as info:
        SamplingParams.from_mapping({field: value})
    assert info.value.param == field and field in str(info.value)


def test_bias_ids_are_checked_against_the_vocabulary():
    with pytest.raises(RequestError, match="'logit_bias' has ids \\[97\\] outside the vocabulary"):
        SamplingParams(logit_bias={"97": 1}).check_vocab(VOCAB)
    assert SamplingParams(logit_bias={"96": 1}).check_vocab(VOCAB).logit_bias == ((96, 1.0),)
