"""Sampling: parameter validation, filters against transformers' processors, seeds, stops, logprobs."""

from __future__ import annotations

import pytest
import torch
from mstar_kvcache.sampler import apply_repetition_penalty, draw, filtered, sample

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
    probs, keep = filtered(logits, [params] * 3)
    ours = torch.where(keep, probs, 0.0)
    ours = ours / ours.sum(-1, keepdim=True)
    ids = torch.zeros(3, 1, dtype=torch.long)
    ref = TemperatureLogitsWarper(0.7)(ids, logits.clone())
    for warp in (TopKLogitsWarper(10), TopPLogitsWarper(0.8), MinPLogitsWarper(0.05)):
        ref = warp(ids, ref)
    torch.testing.assert_close(ours, ref.softmax(-1), atol=1e-6, rtol=1e-5)


def _sorted_nucleus(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, min_p: float) -> torch.Tensor:
    """The textbook filter chain with a full sort, as a mask in vocabulary order (the reference)."""
    scaled = logits / temperature
    if top_k:
        scaled = scaled.masked_fill(scaled < scaled.topk(top_k).values[..., -1:], float("-inf"))
    probs = scaled.softmax(-1)
    sorted_probs, order = probs.sort(-1, descending=True)
    above = sorted_probs.double().cumsum(-1) - sorted_probs.double()
    keep = (above <= top_p) & (sorted_probs > 0) & (sorted_probs >= min_p * sorted_probs[..., :1])
    return torch.zeros_like(keep).scatter(-1, order, keep)


@pytest.mark.parametrize("vocab", [50, 4096, 29004])
@pytest.mark.parametrize("spread", [0.3, 3.0, 30.0])
def test_histogram_top_p_keeps_the_sorted_nucleus(vocab, spread):
    gen = torch.Generator().manual_seed(vocab + int(spread * 10))
    logits = torch.randn(6, vocab, generator=gen) * spread
    cases = [(0.6, 0.8, 0, 0.0), (1.0, 0.95, 0, 0.0), (0.7, 0.5, 40, 0.0), (1.3, 0.9, 0, 0.05), (0.5, 0.1, 0, 0.0),
             (1.0, 0.999, 7, 0.01)]
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, min_p=m) for t, p, k, m in cases]
    _, keep = filtered(logits, params)
    for row, case in enumerate(cases):
        ref = _sorted_nucleus(logits[row], *case)
        # the cut may differ only where the mass above a token equals top_p up to rounding
        assert (keep[row] != ref).sum() <= 1, (case, int(keep[row].sum()), int(ref.sum()))
    assert keep.sum(1).min() >= 1


def test_draw_follows_the_kept_distribution():
    probs = torch.tensor([[0.5, 0.0, 0.2, 0.1, 0.15, 0.05]])
    keep = torch.tensor([[True, True, True, False, True, True]])
    n = 20000
    gen = torch.Generator().manual_seed(0)
    picks = draw(probs.expand(n, -1), keep.expand(n, -1), [gen] * n)
    freq = torch.bincount(picks, minlength=6).double() / n
    expected = torch.where(keep, probs, 0.0)[0].double() / 0.9
    assert freq[1] == 0 and freq[3] == 0
    torch.testing.assert_close(freq, expected, atol=0.012, rtol=0)


def test_a_rows_draw_does_not_depend_on_its_batch():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(1)) * 2
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=[0, 20, 0, 5, 0][i], repetition_penalty=1.3) for i in range(5)]
    history = [[1, 2, 3], [4], [5, 5, 6, 7], [8], [9, 10]]
    alone = sample(logits[2:3], params[2:3], [torch.Generator().manual_seed(7)], history[2:3]).tokens[0]
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 7, 3, 4)]
    assert sample(logits, params, gens, history).tokens[2] == alone


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


def test_logprob_output_only_when_declared_and_asked_for(llama_pair):
    from mstar_kvcache import KVCacheEngine

    from mstar_core.graph import GraphNode
    from mstar_core.runtime.engine import EngineContext, Invocation

    _, ours = llama_pair
    outs = {}
    asks = {"sampling": SamplingParams(logprobs=0)}
    for declared in (("next_token", "finish_reason", "logprob", "logits"), ("next_token", "finish_reason", "logits")):
        node = GraphNode("lm", inputs=("input_ids",), outputs=declared, engine="kvcache", optional_inputs=("sampling",))
        for extra in ({}, asks):
            engine = KVCacheEngine(node, ours, EngineContext("test", torch.device("cpu"), {"num_pages": 16}))
            engine.add(Invocation("r", "lm", {"input_ids": [3, 4, 5], **extra}, {}))
            (_, outs[len(declared), bool(extra)]), = engine.step()
    with_lp = outs[4, True]
    assert all("logprob" not in outs[key] for key in ((3, False), (3, True), (4, False)))  # not declared, or not asked
    assert len({out["next_token"] for out in outs.values()}) == 1
    assert with_lp["logprob"] == pytest.approx(float(torch.log_softmax(with_lp["logits"], -1).max()), abs=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_take_the_first_maximum_as_torch_does(dtype):
    """All-greedy batches skip the fp32 copy (an argmax kernel over the head's own dtype), mixed ones keep the fp32
    path: both give `max(-1).indices` of the fp32 logits, ties and NaN rows included."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 4099, generator=gen).to(dtype)
    logits[1] = logits[1].round()  # ties: the first maximum
    logits[2, [7, 4000]] = float("nan")  # the first NaN
    logits[3] = float("-inf")
    want = logits.float().max(-1).indices.tolist()
    rows = list(range(6))
    got = sample(logits, [None] * 6, [None] * 6, [[1]] * 6, logprobs=False)
    assert got.tokens == want and got.logprobs == [None] * 6 and got.top_logprobs == [None] * 6
    mixed = [None, SamplingParams(temperature=1.0, seed=1), None, None, None, None]
    gens = [None, torch.Generator().manual_seed(1), None, None, None, None]
    got = sample(logits, mixed, gens, [[1]] * 6, logprobs=False).tokens
    assert [got[i] for i in rows if i != 1] == [want[i] for i in rows if i != 1]
    with_logprobs = sample(logits, [None] * 6, [None] * 6, [[1]] * 6, logprobs=True)
    assert with_logprobs.tokens == want and with_logprobs.logprobs[0] is not None


def test_a_row_at_a_temperature_alone_draws_the_same_token_alone_or_batched():
    """Such rows are drawn by the CPU kernel whatever else the batch holds (top-p, top-k, greedy, penalised rows)."""
    logits = torch.randn(5, 4099, generator=torch.Generator().manual_seed(2)) * 3
    logits[0, :100] = float("-inf")  # (masked columns: never drawn)
    params = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.9, top_p=0.8), None,
              SamplingParams(temperature=1.2, top_k=7), SamplingParams(temperature=1.0, repetition_penalty=1.2)]
    for seed in range(20):
        alone = sample(logits[0:1], params[0:1], [torch.Generator().manual_seed(seed)], [[1]]).tokens[0]
        gens = [torch.Generator().manual_seed(s) for s in (seed, 5, 6, 7, 8)]
        batch = sample(logits, params, gens, [[1], [2], [3], [4], [5, 6]]).tokens
        assert batch[0] == alone and alone >= 100
        last = sample(logits[4:5], params[4:5], [torch.Generator().manual_seed(8)], [[5, 6]]).tokens[0]
        assert batch[4] == last  # (a penalised row at a temperature alone: the kernel too, after the penalty)
