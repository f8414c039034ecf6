"""Compiled steps (`compile: true`) on a node split over 2 gloo ranks: TP=1 eager's greedy tokens.

Every rank compiles the same bucket (while the group loads) and runs the same graph, the collectives
of its split layers opaque ops inside it. The checkpoint is a Llama (llama3 rope, GQA) written by transformers'
`save_pretrained`; its greedy tokens compiled at TP=2 (the prompts batched) must equal eager TP=1's, eager
TP=2's and transformers' own.
"""

from __future__ import annotations

import pytest
import torch
from mstar_kvcache.compiled import compiler_missing

from mstar_core.config import Placement
from tests.cluster.tp_checkpoints import engine_greedy, hf_greedy, make_hf, write_checkpoint

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

NEW = 10
PROMPTS = [list(range(3, 22)), [40, 41, 42], list(range(100, 131))]
RANKS = ("tp", "tp.rank1")


def placement(**settings) -> Placement:
    return Placement.from_dict({"workers": {"tp": {"device": "cpu", "tensor_parallel": 2, "threads": 1}},
                                "nodes": {"lm": "tp"}, "engine_settings": {"lm": settings}})


async def test_compiled_steps_on_a_tp2_group_give_eager_tp1_greedy_tokens(tmp_path):
    if compiler_missing(torch.device("cpu")):
        pytest.skip(compiler_missing(torch.device("cpu")))
    hf = make_hf("llama")
    checkpoint = write_checkpoint(hf, tmp_path / "llama")
    expected = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    assert (await engine_greedy(checkpoint, PROMPTS, NEW))[0] == expected  # TP=1, eager
    assert (await engine_greedy(checkpoint, PROMPTS, NEW, placement()))[0] == expected  # TP=2, eager
    # one bucket: every step of these prompts (prefill of at most 31 rows, decode of 1) pads up to 32 rows
    compiled, loads = await engine_greedy(checkpoint, PROMPTS, NEW, placement(compile=True, compile_buckets=[32]),
                                          gauges=RANKS)
    assert compiled == expected
    for name in RANKS:  # both ranks ran the compiled graph (rank 1 only follows rank 0's steps)
        assert loads[name]["compile_seconds"] > 0, (name, loads[name])
