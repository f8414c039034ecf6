"""Seeded sampling on a label forked with `fork_from` is reproducible: the fork clones its parent's generator."""

from __future__ import annotations

import pytest
import torch
from mstar_kvcache import KVCacheEngine

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
