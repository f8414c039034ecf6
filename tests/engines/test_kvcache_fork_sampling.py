"""Seeded sampling on a label forked with `fork_from` is reproducible: the fork clones its parent's generator;
with `seed_offset` it is a new sample instead (its own generator, seeded seed + offset)."""

from __future__ import annotations

import pytest
import torch
from mstar_kvcache import KVCacheEngine

from mstar_core.errors import RequestError
from mstar_core.graph import GraphNode
from mstar_core.nn.llama import LlamaForCausalLM
from mstar_core.runtime.engine import EngineContext, Invocation
from tests.engines.conftest import TINY

NODE = GraphNode("lm", inputs="input_ids", outputs=("next_token", "finish_reason"), engine="kvcache",
                 optional_inputs="sampling")
PROMPT = [5, 17, 42, 99, 3, 7]
STEPS = 8


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(dict(TINY)).eval()


def sampling(seed):
    return {"temperature": 1.0, "seed": seed, "max_tokens": 100}


def call(engine, label, token, seed, **options):
    engine.add(Invocation("r", "lm", {"input_ids": token, "sampling": sampling(seed)}, {"cache_label": label, **options}))
    (_, out), = engine.step()
    assert not isinstance(out, BaseException), out
    return out["next_token"]


def forked_request(model, fork_seed, global_seed):
    """Prefill 'main' (seed 7), fork 'alt' from it and decode there; the global RNG is scrambled first."""
    torch.manual_seed(global_seed)  # a request must not depend on whatever else drew from the global generator
    engine = KVCacheEngine(NODE, model, EngineContext("t", torch.device("cpu"), {"num_pages": 32, "page_size": 4}))
    token = call(engine, "main", PROMPT, 7)
    tokens = [call(engine, "alt", token, fork_seed, fork_from="main")]
    for _ in range(STEPS - 1):
        tokens.append(call(engine, "alt", tokens[-1], fork_seed))
    return tokens


def test_identical_forked_requests_sample_identically(model):
    assert forked_request(model, 7, global_seed=1) == forked_request(model, 7, global_seed=2)


def test_a_fork_with_another_seed_samples_its_own_stream(model):
    same, other = forked_request(model, 7, global_seed=1), forked_request(model, 8, global_seed=1)
    assert other != same
    assert forked_request(model, 8, global_seed=3) == other


def test_a_fork_continues_its_parents_stream_without_sharing_draws(model):
    """A fork called with the parent's seed samples what the parent would have, and drawing on one leaves the other alone."""
    settings = {"num_pages": 32, "page_size": 4}
    alone = KVCacheEngine(NODE, model, EngineContext("t", torch.device("cpu"), settings))
    token = call(alone, "main", PROMPT, 7)
    solo = [call(alone, "main", token, 7)]
    for _ in range(STEPS - 1):
        solo.append(call(alone, "main", solo[-1], 7))

    both = KVCacheEngine(NODE, model, EngineContext("t", torch.device("cpu"), settings))
    token = call(both, "main", PROMPT, 7)
    alt = [call(both, "alt", token, 7, fork_from="main")]  # forked right after the prefill
    main = [call(both, "main", token, 7)]
    for _ in range(STEPS - 1):  # interleaved: the parent's draws do not move the fork's generator, nor back
        main.append(call(both, "main", main[-1], 7))
        alt.append(call(both, "alt", alt[-1], 7))
    assert main == solo and alt == solo


# -- seed_offset: a fork that is a new sample of its parent's tokens (n > 1 choices) ---------------------------


def run(engine, label, ids, seed, max_tokens, **options):
    engine.add(Invocation("r", "lm", {"input_ids": ids, "sampling": {**sampling(seed), "max_tokens": max_tokens}},
                          {"cache_label": label, **options}))
    (_, out), = engine.step()
    assert not isinstance(out, BaseException), out
    return out["next_token"], out["finish_reason"]


def generate(engine, label, ids, seed, max_tokens, **options):
    """Feed `ids`, then each sampled token back, until a finish reason: [(token, finish_reason), ...]."""
    fork = {k: v for k, v in options.items() if k == "fork_from"}
    rest = {k: v for k, v in options.items() if k != "fork_from"}
    out = [run(engine, label, ids, seed, max_tokens, **fork, **rest)]
    while out[-1][1] is None:
        out.append(run(engine, label, out[-1][0], seed, max_tokens, **rest))
    return out


@pytest.mark.parametrize("offset", [0, 2])
def test_a_fork_with_seed_offset_samples_what_a_request_seeded_seed_plus_offset_does(model, offset):
    settings = {"num_pages": 32, "page_size": 4}
    single = KVCacheEngine(NODE, model, EngineContext("t", torch.device("cpu"), settings))
    want = generate(single, "main", PROMPT, 7 + offset, 5)
    assert [r for _, r in want] == [None] * 4 + ["length"]

    forked = KVCacheEngine(NODE, model, EngineContext("t", torch.device("cpu"), settings))
    run(forked, "main", PROMPT[:-1], 7, 5)  # the parent draws from seed 7 and generates a token of its own
    got = generate(forked, "c", PROMPT[-1:], 7, 5, fork_from="main", seed_offset=offset)
    # its own generator (seed 7 + offset, not a clone of the parent's), nothing generated before its first token
    assert got == want
    assert forked.seqs[("r", "c")].generated == [t for t, _ in want]


def test_seed_offset_must_be_a_non_negative_int(model):
    engine = KVCacheEngine(NODE, model, EngineContext("t", torch.device("cpu"), {"num_pages": 32, "page_size": 4}))
    for bad in (-1, 1.5, True, "2"):
        engine.add(Invocation("r", "lm", {"input_ids": PROMPT, "sampling": sampling(7)},
                              {"cache_label": "main", "seed_offset": bad}))
        (_, out), = engine.step()
        assert isinstance(out, RequestError) and "seed_offset" in str(out), bad
