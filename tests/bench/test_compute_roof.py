"""benchmarks/compute_roof.py's FLOP count against torch's own count of a transformers Llama forward."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))

import compute_roof

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

DIMS = {"hidden": 64, "mlp": 96, "layers": 3, "heads": 4, "kv_heads": 2, "head_dim": 16, "vocab": 300}


@pytest.fixture(scope="module")
def llama():
    config = transformers.LlamaConfig(
        hidden_size=DIMS["hidden"], intermediate_size=DIMS["mlp"], num_hidden_layers=DIMS["layers"],
        num_attention_heads=DIMS["heads"], num_key_value_heads=DIMS["kv_heads"], head_dim=DIMS["head_dim"],
        vocab_size=DIMS["vocab"], tie_word_embeddings=True, attn_implementation="eager")
    return transformers.LlamaForCausalLM(config).eval()


def _counted(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("cached", [0, 1, 7, 40])
def test_a_decode_step_counts_what_torch_counts(llama, cached):
    """One new token after `cached` ones: its linears, its head row, attention over cached + 1 keys."""
    ids = torch.randint(0, DIMS["vocab"], (1, cached + 1))
    cache = transformers.DynamicCache()
    if cached:
        with torch.no_grad():
            cache = llama(ids[:, :cached], cache=cache, use_cache=True).past_key_values
    counted = _counted(lambda: llama(ids[:, cached:], cache=cache, use_cache=True))
    assert compute_roof._forward_flops(DIMS, cached, 1, 1) == counted


def test_a_prompt_is_its_tokens_one_at_a_time_with_one_head_row(llama):
    """The prompt step's count: the same linears and causal attention as its tokens decoded one by one (torch
    counts eager attention's full square, so the triangle is checked this way), and the head for its last row."""
    prompt = 23
    one_by_one = sum(compute_roof._forward_flops(DIMS, t, 1, 0) for t in range(prompt))
    head_row = 2 * DIMS["vocab"] * DIMS["hidden"]
    assert compute_roof.prompt_flops(DIMS, prompt) == one_by_one + head_row
    full_square = 4 * DIMS["heads"] * DIMS["head_dim"] * DIMS["layers"] * prompt * prompt
    causal = 4 * DIMS["heads"] * DIMS["head_dim"] * DIMS["layers"] * prompt * (prompt + 1) // 2
    ids = torch.randint(0, DIMS["vocab"], (1, prompt))
    counted = _counted(lambda: llama(ids, logits_to_keep=1))
    assert compute_roof.prompt_flops(DIMS, prompt) - causal + full_square == counted
    assert compute_roof.request_flops(DIMS, prompt, 5) == (
        compute_roof.prompt_flops(DIMS, prompt) + sum(compute_roof._forward_flops(DIMS, prompt + i, 1, 1)
                                                      for i in range(4)))


def test_the_roof_and_its_shares():
    prompts = {8: [[0] * 100] * 16}
    roof = compute_roof.roof_tok_s(DIMS, prompts[8], 10, 1.0)
    flops = 16 * compute_roof.request_flops(DIMS, 100, 10)
    assert roof == pytest.approx(160 / (flops / 1e9))
    out = compute_roof.summary(DIMS, {"float32": 1.0}, {1: [[0] * 9, [0] * 5, [0] * 7], **prompts}, 10,
                               {"float32": {1: {"mstar": 1.0, "llamacpp": 1.0}, 8: {"mstar": roof / 2, "llamacpp": roof / 4}}},
                               {"float32": {"mstar": 1e3, "llamacpp": 2e3}}, {1: 1.3, 8: 2.0}, 0.6, {"float32": "fp32"})
    assert "c1_fp32" not in out  # one stream is the memory's to pace
    assert out["c8_fp32"]["mstar"] == 0.5 and out["c8_fp32"]["llamacpp"] == 0.25 and out["c8_fp32"]["target"] == 0.5
    roof_ms = compute_roof.prompt_flops(DIMS, 7) / 1e9 * 1e3  # the median of 9, 5 and 7 tokens
    assert out["ttft_c1_fp32"]["roof_ms"] == round(roof_ms, 1)
    assert out["ttft_c1_fp32"]["mstar"] == round(roof_ms / 1e3, 3)
    assert out["ttft_c1_fp32"]["target"] == round(roof_ms / 1.2e3, 3)
