"""Top-k rows sampled over their k candidates: the same tokens as the whole-vocabulary path, ties, boundaries, batches."""

from __future__ import annotations

import math

import pytest
import torch
from mstar_kvcache import candidates
from mstar_kvcache.sampler import adjust_logits, draw, filtered, sample

from mstar_core.sampling import SamplingParams


def _whole_vocabulary(logits, params, seeds, history):
    """The path every row took before candidates: penalties, filters over the whole vocabulary, one draw per row."""
    adjusted = adjust_logits(logits.float(), params, history, history)
    probs, keep = filtered(adjusted, params)
    return draw(probs, keep, [torch.Generator().manual_seed(s) for s in seeds]).tolist()


def _sample(logits, params, seeds, history=None):
    history = history or [[] for _ in params]
    return sample(logits, params, [torch.Generator().manual_seed(s) for s in seeds], history, logprobs=False).tokens


@pytest.fixture
def taken(monkeypatch):
    """Counts the rows the candidate path sampled (so a test cannot pass by never taking it)."""
    count = [0]
    real = candidates.take

    def counting(logits, k, params):
        ids, weights, wide = real(logits, k, params)
        count[0] += ids.shape[0]
        return ids, weights, wide

    monkeypatch.setattr(candidates, "take", counting)
    return count


def test_candidates_draw_what_the_whole_vocabulary_draws(taken):
    rows, draws = 4, 0
    for case in range(60):
        gen = torch.Generator().manual_seed(case)
        vocab = (400, 2048, 8192)[case % 3]
        logits = torch.randn(rows, vocab, generator=gen) * (0.3, 1.0, 3.0, 10.0)[case % 4]
        params = [SamplingParams(temperature=(0.5, 1.0, 1.7)[(case + i) % 3], top_k=(2, 5, 50, 17)[(case + i) % 4],
                                 top_p=(1.0, 0.8, 0.3, 0.95)[(case // 3 + i) % 4], min_p=(0.0, 0.05)[(case + i) % 2],
                                 repetition_penalty=(1.0, 1.3)[case % 2], presence_penalty=(0.0, 0.5)[case % 5 == 0])
                  for i in range(rows)]
        history = [[int(t) for t in logits[i].topk(3).indices] + [case % vocab] for i in range(rows)]
        seeds = [case * 10 + i for i in range(rows)]
        assert _sample(logits, params, seeds, history) == _whole_vocabulary(logits, params, seeds, history), case
        draws += rows
    assert taken[0] == draws


def test_a_code_predictor_row_masked_to_one_head():
    """The joined vocabulary's shape: one head's 2,048 ids finite, the other 28,672 -inf."""
    logits = torch.full((3, 30720), float("-inf"))
    for row in range(3):
        logits[row, row * 2048 : (row + 1) * 2048] = torch.randn(2048, generator=torch.Generator().manual_seed(row)) * 2
    params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.8)] * 3
    for seed in range(12):
        seeds = [seed, seed + 100, seed + 200]
        got = _sample(logits, params, seeds)
        assert got == _whole_vocabulary(logits, params, seeds, [[]] * 3)
        assert all(row * 2048 <= t < (row + 1) * 2048 for row, t in enumerate(got))


def test_ties_at_the_kth_logit_keep_every_tie(taken):
    """Ten ids share the 3rd-largest logit: top-k 3 keeps all twelve (transformers' rule), via the whole vocabulary."""
    logits = torch.zeros(1, 64)
    logits[0, 10], logits[0, 20] = 2.0, 1.5
    logits[0, 30:40] = 1.0
    params = [SamplingParams(temperature=1.0, top_k=3)]
    seen = set()
    for seed in range(150):
        token = _sample(logits, params, [seed])[0]
        assert token == _whole_vocabulary(logits, params, [seed], [[]])[0]
        seen.add(token)
    assert seen == {10, 20, *range(30, 40)}
    assert taken[0] == 0  # every draw went the whole-vocabulary way


def test_ties_made_by_the_temperature_are_seen():
    """Logits one float32 ulp apart round to the same scaled value: the k-th and the next tie after scaling."""
    logits = torch.full((1, 64), -5.0)
    logits[0, 0] = 3.0
    logits[0, 1] = 1.0
    logits[0, 2] = math.nextafter(1.0, 0.0)  # distinct logits ...
    temperature = 1e-5 * 3  # ... whose quotients are equal
    assert float(logits[0, 1] / temperature) == float(logits[0, 2] / temperature)
    ids, _, wide = candidates.take(logits, 2, [SamplingParams(temperature=temperature, top_k=2)])
    assert wide == [0] and ids.shape[0] == 0


def test_top_p_boundary_keeps_the_token_whose_mass_above_equals_top_p():
    """The rule: keep a token when the mass strictly above it is <= top_p, and every token as probable as one kept."""
    logits = torch.full((1, 64), float("-inf"))
    logits[0, [5, 9, 12, 40]] = torch.tensor([2.0, 1.0, 0.5, 0.0])
    _, weights, _ = candidates.take(logits, 4, [SamplingParams(temperature=1.0, top_k=4)])
    probs = weights[0]  # vocabulary order is the descending order here
    above_third = float(probs[0].double() + probs[1].double())
    for top_p, kept in ((above_third, 3), (math.nextafter(above_third, 0.0), 2), (float(probs[0].double()), 2)):
        _, weights, _ = candidates.take(logits, 4, [SamplingParams(temperature=1.0, top_k=4, top_p=top_p)])
        assert int((weights[0] > 0).sum()) == kept, top_p
    # equal probabilities: the second of two ties is kept with the first, though the mass above it exceeds top_p
    tied = torch.full((1, 64), float("-inf"))
    tied[0, [3, 7, 8]] = torch.tensor([1.0, 0.0, 0.0])
    _, weights, _ = candidates.take(tied, 3, [SamplingParams(temperature=1.0, top_k=3)])
    top_p = float(weights[0, 0].double())
    _, weights, _ = candidates.take(tied, 3, [SamplingParams(temperature=1.0, top_k=3, top_p=top_p)])
    assert (weights[0] > 0).tolist() == [True, True, True]
    _, keep_full = filtered(tied, [SamplingParams(temperature=1.0, top_k=3, top_p=top_p)])
    assert keep_full[0, [3, 7, 8]].tolist() == [True, True, True]


def test_a_row_samples_the_same_alone_and_in_any_batch(taken):
    gen = torch.Generator().manual_seed(5)
    vocab = 4096
    logits = torch.randn(7, vocab, generator=gen) * 2
    logits[3, 100:110] = logits[3].max() - 0.0  # ties at the top: top-k 5 keeps ten (whole vocabulary)
    logits[5, 7] = float("nan")  # a broken row breaks no other
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9), SamplingParams(temperature=1.1, top_k=20),
              SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.0, top_k=5),
              SamplingParams(), SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=0.9, top_k=50,
                                                                                           min_p=0.1)]
    for base in range(6):
        seeds = [base * 7 + i for i in range(7)]
        batched = _sample(logits, params, seeds)
        alone = [_sample(logits[i : i + 1], params[i : i + 1], seeds[i : i + 1])[0] for i in range(7)]
        assert batched == alone, base
        assert batched[4] == int(logits[4].argmax())
    assert taken[0] > 0


def test_logprobs_stay_over_the_whole_vocabulary():
    logits = torch.randn(2, 4096, generator=torch.Generator().manual_seed(2)) * 3
    params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.5, logprobs=2)] * 2
    out = sample(logits, params, [torch.Generator().manual_seed(s) for s in (1, 2)], [[], []])
    full = logits.log_softmax(-1)
    for row, token in enumerate(out.tokens):
        assert out.logprobs[row] == pytest.approx(float(full[row, token]), abs=1e-5)
        assert [t for t, _ in out.top_logprobs[row]] == full[row].topk(2).indices.tolist()


def test_narrowing_depends_on_the_row_alone():
    assert candidates.narrows(SamplingParams(temperature=1.0, top_k=50), 30720)
    assert not candidates.narrows(SamplingParams(temperature=1.0, top_k=1), 30720)  # greedy
    assert not candidates.narrows(SamplingParams(temperature=1.0, top_k=0), 30720)
    assert not candidates.narrows(SamplingParams(temperature=1.0, top_k=50), 100)  # little left to save


def test_the_draw_mask_draws_what_the_exact_mask_draws():
    """`filtered(for_draw=True)` may keep tokens of probability 0 (two passes fewer): the draws stay the same."""
    for case in range(40):
        gen = torch.Generator().manual_seed(case)
        logits = torch.randn(4, 3000, generator=gen) * (0.3, 3.0, 30.0, 100.0)[case % 4]
        if case % 5 == 0:
            logits[1, 7] = float("nan")
            logits[2] = float("-inf")
        params = [SamplingParams(temperature=(0.6, 1.0)[(case + i) % 2], top_p=(1.0, 0.8, 0.999999, 0.3)[(case + i) % 4],
                                 min_p=(0.0, 0.1)[case % 3 == 0]) for i in range(4)]
        probs, keep = filtered(logits, params)
        cheap_probs, cheap_keep = filtered(logits, params, for_draw=True)
        assert torch.equal(probs, cheap_probs)
        if cheap_keep is None:
            assert bool(keep.eq(probs > 0).all())
            cheap_keep = torch.ones_like(keep)
        assert torch.equal(keep, cheap_keep & (probs > 0))  # the same mask where anything can be drawn
        seeds = [case * 4 + i for i in range(4)]
        assert (draw(probs, keep, [torch.Generator().manual_seed(s) for s in seeds]).tolist()
                == draw(cheap_probs, cheap_keep, [torch.Generator().manual_seed(s) for s in seeds]).tolist())
