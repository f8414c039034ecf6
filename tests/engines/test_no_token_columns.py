"""Ids no token stands for (a vocabulary padded past its tokenizer) are never sampled by the kvcache engine: not
greedily, not drawn at any temperature or filter, not listed among top log-probabilities, even where the model
gives them nearly all the mass; a module without a tokenizer (no `grammar_vocab`) samples its whole vocabulary."""

from __future__ import annotations

import pytest
import torch
from mstar_kvcache.no_token import NoTokenColumns

from mstar_core.graph import GraphNode
from tests.engines.paged_tiny import VOCAB, TinyNode, engine_for, run

TAIL = 48  # ids 48..63 are the padded tail, as a checkpoint rounds its embedding up
HOLES = (20, 33)  # ids with no token below the tail (a tokenizer with gaps)
NO_TOKEN = {*HOLES, *range(TAIL, VOCAB)}
NODE = GraphNode("lm", inputs=("input_ids",), optional_inputs=("sampling",),
                 outputs=("next_token", "finish_reason", "logprob", "top_logprobs"), engine="kvcache")
PROMPT = [3, 9, 14, 1, 22, 7]


def _module(padded_mass: float = 40.0) -> TinyNode:
    """The tiny node with its padded columns boosted: without the mask they are the argmax of every row."""
    from mstar_core.grammar import GrammarVocab

    module = TinyNode()
    with torch.no_grad():
        module.head.bias[sorted(NO_TOKEN)] += padded_mass
    pieces = tuple(b"" if i in NO_TOKEN or i == 0 else bytes([97 + i % 26]) for i in range(VOCAB))
    module.grammar_vocab = GrammarVocab(pieces, (0,), VOCAB, tuple(sorted(NO_TOKEN)))
    return module


def _decode(engine, rid: str, sampling: dict, steps: int = 12) -> list[dict]:
    outs = [run(engine, rid, {"input_ids": PROMPT, "sampling": sampling})]
    for _ in range(steps - 1):
        outs.append(run(engine, rid, {"input_ids": [outs[-1]["next_token"]], "sampling": sampling}))
    engine.release(rid)
    return outs


@pytest.mark.parametrize("sampling", [
    {"temperature": 0},
    {"temperature": 1.0},
    {"temperature": 5.0, "top_p": 0.99},
    {"temperature": 2.0, "top_k": 40},
    {"temperature": 1.5, "min_p": 0.01, "logit_bias": {"50": 100, "20": 100}},
])
def test_padded_ids_are_never_sampled(sampling):
    engine = engine_for(_module(), NODE)
    for seed in range(6):
        outs = _decode(engine, f"r{seed}", {**sampling, "seed": seed, "max_tokens": 64, "logprobs": 5})
        tokens = [o["next_token"] for o in outs]
        assert not NO_TOKEN & set(tokens), tokens
        for out in outs:
            assert len(out["top_logprobs"]) == 5 and not NO_TOKEN & {t for t, _ in out["top_logprobs"]}
            assert out["logprob"] <= 0.0 and torch.isfinite(torch.tensor(out["logprob"]))


def test_without_the_mask_the_same_model_samples_them():
    """The check above could fail: the boosted model left alone picks a padded id greedily."""
    module = _module()
    module.grammar_vocab = None
    engine = engine_for(module, NODE)
    assert engine.no_token is None
    assert _decode(engine, "a", {"temperature": 0, "max_tokens": 4}, steps=1)[0]["next_token"] in NO_TOKEN


def test_columns_split_into_the_tail_and_the_holes_below_it():
    from mstar_core.grammar import GrammarVocab

    cols = NoTokenColumns.of(_module().grammar_vocab, VOCAB, torch.device("cpu"))
    assert cols.tail == TAIL and cols.holes.tolist() == list(HOLES)
    logits = torch.zeros(3, VOCAB)
    cols.fill(logits)
    assert {i for i in range(VOCAB) if logits[0, i] == float("-inf")} == NO_TOKEN and (logits[1] == logits[0]).all()
    tail_only = NoTokenColumns.of(GrammarVocab((b"a",) * 8, (0,), 8, (6, 7)), 8, torch.device("cpu"))
    assert tail_only.tail == 6 and tail_only.holes is None
    assert NoTokenColumns.of(GrammarVocab((b"a",) * 8, (0,), 8), 8, torch.device("cpu")) is None
    assert NoTokenColumns.of(None, 8, torch.device("cpu")) is None
