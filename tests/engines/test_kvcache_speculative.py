"""Speculative decoding (setting `speculative`): greedy output identical to plain decoding, sampled output with
plain sampling's distribution, guesses' keys rolled back, a cancel in the middle frees everything."""

from __future__ import annotations

import math

import pytest
import torch
from mstar_kvcache.proposers import NgramProposer
from mstar_kvcache.sampler import filtered
from mstar_kvcache.speculative import Speculator, verify_draws

from mstar_core.errors import ConfigError
from mstar_core.graph import GraphNode
from mstar_core.runtime.engine import Invocation
from mstar_core.sampling import SamplingParams
from tests.engines.paged_tiny import LM_NODE, TinyNode, engine_for, run

NGRAM = {"method": "ngram", "num_tokens": 4, "max_ngram": 3, "min_ngram": 1}
#: a prompt that repeats itself: the tiny model's greedy continuation falls into a loop prompt lookup predicts
PROMPT = [3, 9, 14, 1, 22, 7, 3, 9, 14, 1, 22, 7, 5]
GREEDY = {"temperature": 0.0, "max_tokens": 40}
SHORT = {**GREEDY, "max_tokens": 20}
LOGPROB_NODE = GraphNode("lm", inputs=("input_ids",), optional_inputs=("sampling",),
                         outputs=("next_token", "finish_reason", "hidden", "logprob", "top_logprobs"), engine="kvcache")


def _check_pages(engine, rid: str) -> None:
    """Between calls every token of the label is computed, its pages hold exactly them, and no page leaks."""
    seq = engine.seqs[(rid, "main")]
    assert seq.num_computed == len(seq.tokens)
    assert len(seq.pages) == -(-seq.num_computed // engine.pool.page_size)
    assert engine.pool.num_used == sum(len(s.pages) for s in engine.seqs.values())


def _generate(engine, rid: str, prompt: list[int], sampling: dict, check: bool = False) -> list[dict]:
    """The decode walk's calls, one by one: the prompt, then each token fed back until a finish reason."""
    outs = [run(engine, rid, {"input_ids": prompt, "sampling": sampling})]
    while outs[-1]["finish_reason"] is None:
        outs.append(run(engine, rid, {"input_ids": [outs[-1]["next_token"]], "sampling": sampling}))
        if check:
            _check_pages(engine, rid)
    return outs


def _tokens(outs: list[dict]) -> list[int]:
    return [o["next_token"] for o in outs]


def test_greedy_output_is_plain_decodings_in_fewer_forwards():
    module = TinyNode()
    plain = engine_for(module, LM_NODE)
    want = _generate(plain, "a", PROMPT, GREEDY)
    spec = engine_for(module, LM_NODE, speculative=NGRAM)
    got = _generate(spec, "a", PROMPT, GREEDY, check=True)
    assert _tokens(got) == _tokens(want) and len(got) == GREEDY["max_tokens"]
    assert got[-1]["finish_reason"] == "length"
    for g, w in zip(got, want, strict=True):  # every call's outputs, the hidden row included
        torch.testing.assert_close(g["hidden"], w["hidden"], atol=1e-5, rtol=0)
    stats = spec.stats()
    assert stats["spec_accepted_tokens"] >= 10 and spec.num_steps < plain.num_steps - 10
    assert spec.seqs[("a", "main")].tokens == plain.seqs[("a", "main")].tokens
    assert spec.pool.num_used == plain.pool.num_used


def test_stop_tokens_max_tokens_and_logprobs_hold_under_speculation():
    module = TinyNode()
    want = _generate(engine_for(module, LOGPROB_NODE), "a", PROMPT, {**GREEDY, "logprobs": 3})
    tokens = _tokens(want)
    stop = tokens[20]  # a token inside the loop: the first time it comes, generation stops there
    first = tokens.index(stop)
    sampling = {**GREEDY, "logprobs": 3, "stop_token_ids": [stop]}
    got = _generate(engine_for(module, LOGPROB_NODE, speculative=NGRAM), "a", PROMPT, sampling)
    assert _tokens(got) == tokens[: first + 1] and got[-1]["finish_reason"] == "stop"
    for g, w in zip(got, want, strict=False):
        assert g["logprob"] == pytest.approx(w["logprob"], abs=1e-4)
        assert [t for t, _ in g["top_logprobs"]] == [t for t, _ in w["top_logprobs"]]
    short = _generate(engine_for(module, LM_NODE, speculative=NGRAM), "b", PROMPT, {**GREEDY, "max_tokens": 7})
    assert _tokens(short) == tokens[:7] and short[-1]["finish_reason"] == "length"


def test_rejected_guesses_roll_back_their_pages_and_sampling_keeps_going():
    module = TinyNode()
    # sampled at a high temperature the model wanders: most guesses are rejected and rolled back
    sampling = {"temperature": 1.5, "seed": 3, "max_tokens": 60}
    engine = engine_for(module, LM_NODE, speculative={**NGRAM, "min_ngram": 1})
    outs = _generate(engine, "a", PROMPT, sampling, check=True)
    stats = engine.stats()
    assert len(outs) == 60 and stats["spec_proposed_tokens"] > stats["spec_accepted_tokens"]
    seq = engine.seqs[("a", "main")]
    assert seq.tokens == PROMPT + _tokens(outs)[:-1]  # the label holds exactly the tokens handed out
    assert seq.generated == _tokens(outs)


def test_a_cancel_in_the_middle_of_verified_tokens_frees_every_page():
    module = TinyNode()
    engine = engine_for(module, LM_NODE, speculative=NGRAM, enable_prefix_caching=False)
    out = [run(engine, "a", {"input_ids": PROMPT, "sampling": GREEDY})]
    while not engine.seqs[("a", "main")].speculation or not engine.seqs[("a", "main")].speculation.ahead:
        out.append(run(engine, "a", {"input_ids": [out[-1]["next_token"]], "sampling": GREEDY}))
    assert engine.pool.num_used > 0
    engine.release("a")
    assert engine.pool.num_used == 0 and not engine.seqs and not engine.has_work()


def test_a_call_that_does_not_feed_back_the_token_settles_the_label():
    module = TinyNode()
    engine = engine_for(module, LM_NODE, speculative=NGRAM)
    out = [run(engine, "a", {"input_ids": PROMPT, "sampling": GREEDY})]
    while not engine.seqs[("a", "main")].speculation or not engine.seqs[("a", "main")].speculation.ahead:
        out.append(run(engine, "a", {"input_ids": [out[-1]["next_token"]], "sampling": GREEDY}))
    # another token than the one returned: the verified tokens ahead go, their keys roll back
    other = (out[-1]["next_token"] + 1) % 64
    got = run(engine, "a", {"input_ids": [other], "sampling": GREEDY})
    history = PROMPT + [o["next_token"] for o in out[:-1]] + [other]
    plain = engine_for(module, LM_NODE)
    assert got["next_token"] == run(plain, "a", {"input_ids": history, "sampling": GREEDY})["next_token"]
    _check_pages(engine, "a")
    assert engine.seqs[("a", "main")].tokens[: len(history)] == history
    # a fork taken while tokens wait ahead sees only the tokens handed out
    while not engine.seqs[("a", "main")].speculation.ahead:
        got = run(engine, "a", {"input_ids": [got["next_token"]], "sampling": GREEDY})
    handed = len(engine.seqs[("a", "main")].tokens) - len(engine.seqs[("a", "main")].speculation.ahead)
    engine.fork("a", "main", "branch")
    assert len(engine.seqs[("a", "branch")].tokens) == handed == len(engine.seqs[("a", "main")].tokens)


def test_penalised_rows_speculate_with_plain_decodings_output_and_decode_steps_rows_do_not():
    module = TinyNode()
    engine = engine_for(module, LM_NODE, speculative=NGRAM)
    # penalties read each row's history: a verify row's includes the guesses before it
    penalised = {**GREEDY, "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.3}
    want = _generate(engine_for(module, LM_NODE), "a", PROMPT, penalised)
    assert _tokens(_generate(engine, "a", PROMPT, penalised)) == _tokens(want)
    assert engine.stats()["spec_proposed_tokens"] > 0
    stepped = engine_for(module, LM_NODE, speculative=NGRAM)
    got = run(stepped, "b", {"input_ids": PROMPT, "sampling": GREEDY}, decode_steps=12)
    assert got["next_token"] == _tokens(_generate(engine_for(module, LM_NODE), "b", PROMPT, GREEDY))[:12]
    assert stepped.stats()["spec_proposed_tokens"] == 0


def test_rejection_sampling_keeps_the_distribution_exact():
    """Each output token of a verify has plain sampling's distribution (chi-square over 40,000 draws)."""
    chi2 = pytest.importorskip("scipy.stats").chi2
    torch.manual_seed(0)
    vocab = 6
    logits = torch.randn(3, vocab) * 1.5
    params = SamplingParams(temperature=0.9, top_k=5)  # one token filtered out: never drawn
    probs, keep = filtered(logits, [params] * 3)
    p = probs * keep
    p = p / p.sum(-1, keepdim=True)
    drafts = [int(p[0].argmax()), int(p[1].argmin())]  # a likely guess, then an impossible one
    draws = 40_000
    kept, last = verify_draws(probs * keep, drafts, torch.rand(draws, 3, generator=torch.Generator().manual_seed(11),
                                                                 dtype=torch.float64))
    first = torch.where(kept >= 1, drafts[0], last)
    second = last[kept >= 1]  # the token after an accepted first guess
    assert int((kept == 2).sum()) == 0  # a guess of probability 0 is never accepted
    for counts, want in ((torch.bincount(first, minlength=vocab), p[0]), (torch.bincount(second, minlength=vocab), p[1])):
        assert int(counts[want == 0].sum()) == 0  # filtered tokens never come out
        expected = want[want > 0] * counts.sum()
        stat = float(((counts[want > 0] - expected) ** 2 / expected).sum())
        assert stat < chi2.ppf(0.999, int((want > 0).sum()) - 1), (counts, expected)
    # and through the engine's own path, one verification at a time with a request's generator
    gen = torch.Generator().manual_seed(5)
    outs = [Speculator._sample(logits, drafts, params, gen) for _ in range(300)]
    assert all(o[: len(o) - 1] == drafts[: len(o) - 1] and len(o) <= 2 for o in outs)
    assert math.isclose(sum(o[0] == drafts[0] for o in outs) / 300, float(p[0, drafts[0]]), abs_tol=0.1)


def test_prompt_lookup_proposes_what_followed_the_longest_earlier_suffix():
    proposer = NgramProposer(max_ngram=3, min_ngram=1)
    assert proposer.propose([1, 2, 3, 4, 9, 2, 3], 2) == [4, 9]
    assert proposer.propose([5, 2, 3, 7, 1, 2, 3, 8, 2, 3], 3) == [8, 2, 3]  # the latest occurrence
    assert proposer.propose([1, 2, 3, 4], 3) == []
    assert proposer.propose([7, 7], 4) == [7]
    # ids that straddle byte boundaries never match across two tokens
    assert proposer.propose([256, 1, 0, 0], 2) == [0]
    assert NgramProposer(3, 2).propose([1, 2, 9, 5, 2], 2) == []


@pytest.mark.parametrize(("value", "named"), [
    ({"method": "medusa"}, "speculative.method"),
    ({"method": "ngram", "num_tokens": 0}, "speculative.num_tokens"),
    ({"method": "ngram", "typo": 1}, "speculative.typo"),
    ({"method": "ngram", "min_ngram": 4, "max_ngram": 2}, "speculative.min_ngram"),
    ("ngram", "speculative"),
])
def test_bad_settings_name_the_key(value, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        engine_for(TinyNode(), LM_NODE, speculative=value)


def test_a_batch_of_rows_speculates_each_on_its_own():
    module = TinyNode()
    prompts = {"a": PROMPT, "b": [5, 6, 7, 5, 6, 7, 5], "c": [40, 41, 40, 41, 40]}
    want = {rid: _tokens(_generate(engine_for(module, LM_NODE), rid, p, SHORT)) for rid, p in prompts.items()}
    engine = engine_for(module, LM_NODE, speculative=NGRAM)
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    for rid, p in prompts.items():
        engine.add(Invocation(rid, "lm", {"input_ids": p, "sampling": SHORT}, {}))
    while engine.has_work():
        for inv, out in engine.step():
            got[inv.request_id].append(out["next_token"])
            if out["finish_reason"] is None:
                engine.add(Invocation(inv.request_id, "lm", {"input_ids": [out["next_token"]], "sampling": SHORT},
                                      {}))
    assert got == want and engine.stats()["spec_accepted_tokens"] > 0


def test_m_rope_positions_continue_through_guesses():
    """A Thinker-like node (3-axis positions given with the prompt, implicit after it): identical greedy output."""
    module = TinyNode(axes=3)
    node = GraphNode("lm", inputs=("input_ids",), optional_inputs=("sampling", "positions"),
                     outputs=("next_token", "finish_reason", "hidden"), engine="kvcache")
    positions = torch.arange(len(PROMPT)).expand(3, -1).clone()
    positions[1, 4:8] = 2  # a media span: its positions differ per axis, as M-RoPE's do
    outs = {}
    for name, settings in (("plain", {}), ("spec", {"speculative": NGRAM})):
        engine = engine_for(module, node, **settings)
        got = [run(engine, "a", {"input_ids": PROMPT, "positions": positions, "sampling": SHORT})]
        while got[-1]["finish_reason"] is None:
            got.append(run(engine, "a", {"input_ids": [got[-1]["next_token"]], "sampling": SHORT}))
        outs[name] = (_tokens(got), engine.seqs[("a", "main")].positions, engine.stats().get("spec_accepted_tokens"))
    assert outs["spec"][0] == outs["plain"][0] and outs["spec"][2] > 0
    assert torch.equal(outs["spec"][1], outs["plain"][1])  # the positions recorded for every token are the same
