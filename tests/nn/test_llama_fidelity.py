"""Fidelity: M*'s decoder, loaded from a HF-layout checkpoint by M*'s loader, vs transformers with the same weights."""

from __future__ import annotations

import pytest
import torch

from mstar_core.checkpoint import save_hf_checkpoint
from mstar_core.nn import DenseAttention, load_llama

transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

CONFIGS = {
    # GQA 2:1, default rope, untied head
    "llama-gqa2": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2)),
    # GQA 4:1, llama3 rope scaling, tied embeddings, head_dim != hidden/heads
    "llama-gqa4-llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=12, rope_theta=5e5,
             rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True),
    ),
    # q/k/v biases
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2)),
    # per-head qk-norm
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16)),
}


def make_hf(kind: str, seed: int = 0):
    cfg_cls, model_cls, extra = CONFIGS[kind]
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)
    cfg = getattr(transformers, cfg_cls)(**{**base, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: randomize so they are really tested
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_logits_match_transformers(kind, tmp_path):
    hf = make_hf(kind)
    save_hf_checkpoint(hf, tmp_path, hf.config.to_dict())
    ours = load_llama(tmp_path, progress=False)
    ids = torch.randint(0, 256, (1, 77), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=ids).logits[0]
        hidden = ours(ids[0], torch.arange(77), DenseAttention())
        got = ours.compute_logits(hidden)
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= 1e-4, f"{kind}: max abs logit error {err}"


def test_packed_sequences_equal_separate(tmp_path):
    hf = make_hf("llama-gqa4-llama3")
    save_hf_checkpoint(hf, tmp_path, hf.config.to_dict())
    ours = load_llama(tmp_path, progress=False)
    a, b = torch.randint(0, 256, (9,)), torch.randint(0, 256, (14,))
    ids = torch.cat([a, b])
    positions = torch.cat([torch.arange(9), torch.arange(14)])
    seq = torch.cat([torch.zeros(9), torch.ones(14)])
    mask = (seq[:, None] == seq[None, :]) & torch.ones(23, 23, dtype=torch.bool).tril()
    with torch.no_grad():
        packed = ours(ids, positions, DenseAttention(mask=mask))
        sep = torch.cat([ours(a, torch.arange(9), DenseAttention()), ours(b, torch.arange(14), DenseAttention())])
    torch.testing.assert_close(packed, sep, atol=1e-5, rtol=1e-5)


def test_dtype_conversion(tmp_path):
    hf = make_hf("llama-gqa2")
    save_hf_checkpoint(hf, tmp_path, hf.config.to_dict())
    ours = load_llama(tmp_path, dtype=torch.bfloat16, progress=False)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    hidden = ours(torch.tensor([1, 2, 3]), torch.arange(3), DenseAttention())
    assert hidden.dtype == torch.bfloat16 and torch.isfinite(hidden).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_chained_through_their_norms_give_the_per_layer_bits(dtype, tmp_path):
    """`run_layers` joins each layer's closing add to the norm after it (one kernel): the same bits as each layer's
    own call then the final norm (the path a forward hook on the final norm keeps)."""
    from mstar_core.nn import cpu_elementwise, llama

    hf = make_hf("llama-gqa4-llama3")
    save_hf_checkpoint(hf, tmp_path, hf.config.to_dict())
    ours = load_llama(tmp_path, dtype=dtype, progress=False)
    ids = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(2))
    calls = []
    fused = cpu_elementwise.add_rms_norm_

    def counted(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)

    with torch.inference_mode():
        llama.cpu_elementwise.add_rms_norm_ = counted  # (norm.py's module object: the same one)
        try:
            chained = ours(ids, torch.arange(37), DenseAttention())
        finally:
            llama.cpu_elementwise.add_rms_norm_ = fused
        handle = ours.model.norm.register_forward_hook(lambda module, args, out: None)
        try:
            per_layer = ours(ids, torch.arange(37), DenseAttention())
        finally:
            handle.remove()
    assert len(calls) == 2 * ours.num_layers  # the post-attention norm and the closing add's, each layer
    assert torch.equal(chained, per_layer)
