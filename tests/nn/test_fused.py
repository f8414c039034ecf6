"""Fused q/k/v and gate/up linears: one GEMM each in the module, the checkpoint's separate names outside."""

from __future__ import annotations

import pytest
import torch

from mstar_core.nn import DenseAttention, GatedMLP, GroupedQueryAttention, LlamaForCausalLM

transformers = pytest.importorskip("transformers")


def _hf(kind: str):
    cfgs = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),  # q/k/v bias
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),  # qk-norm
    }
    cfg_cls, model_cls, extra = cfgs[kind]
    cfg = cfg_cls(vocab_size=128, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def test_modules_hold_one_linear_each():
    attn = GroupedQueryAttention(64, 8, 2, 16, 0, qkv_bias=True)
    mlp = GatedMLP(64, 96)
    assert [n for n, _ in attn.named_parameters()] == ["qkv_proj.weight", "qkv_proj.bias", "o_proj.weight"]
    assert attn.qkv_proj.weight.shape == (8 * 16 + 2 * 2 * 16, 64)
    assert [n for n, _ in mlp.named_parameters()] == ["gate_up_proj.weight", "down_proj.weight"]


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_state_dict_speaks_the_checkpoint_layout(kind):
    hf = _hf(kind)
    ours = LlamaForCausalLM(hf.config.to_dict())
    want = [k for k in hf.state_dict() if "rotary_emb" not in k]
    got = list(ours.state_dict())
    assert sorted(got) == sorted(want)
    attn = [k.rsplit(".", 2)[1] for k in got if ".layers.0.self_attn." in k]
    assert attn == [k.rsplit(".", 2)[1] for k in want if ".layers.0.self_attn." in k]  # q, k, v, o (weight, bias)
    for k, v in ours.state_dict(keep_vars=True).items():
        assert tuple(v.shape) == tuple(hf.state_dict()[k].shape), k


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_load_state_dict_concatenates_and_matches_transformers(kind):
    hf = _hf(kind)
    with torch.device("meta"):
        ours = LlamaForCausalLM(hf.config.to_dict())
    ours.load_state_dict(hf.state_dict(), strict=True, assign=True)
    attn, ref = ours.model.layers[1].self_attn, hf.model.layers[1].self_attn
    assert torch.equal(attn.qkv_proj.weight, torch.cat([ref.q_proj.weight, ref.k_proj.weight, ref.v_proj.weight]))
    if kind == "qwen2":
        assert torch.equal(attn.qkv_proj.bias, torch.cat([ref.q_proj.bias, ref.k_proj.bias, ref.v_proj.bias]))
    # the state dict round-trips exactly
    for k, v in ours.state_dict().items():
        assert torch.equal(v, hf.state_dict()[k]), k
    ids = torch.randint(0, 128, (23,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=ids[None]).logits[0]
        got = ours.compute_logits(ours(ids, torch.arange(23), DenseAttention()))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_mis_shaped_piece_names_the_checkpoint_key():
    attn = GroupedQueryAttention(32, 4, 2, 8, 0)
    state = {"q_proj.weight": torch.zeros(32, 32), "k_proj.weight": torch.zeros(8, 32),
             "v_proj.weight": torch.zeros(16, 32), "o_proj.weight": torch.zeros(32, 32)}
    with pytest.raises(RuntimeError, match=r"k_proj\.weight: checkpoint \[8, 32\], model expects \[16, 32\]"):
        attn.load_state_dict(state)


def test_missing_piece_is_named():
    mlp = GatedMLP(16, 24)
    got = mlp.load_state_dict({"gate_proj.weight": torch.zeros(24, 16), "down_proj.weight": torch.zeros(16, 24)},
                              strict=False)
    assert "up_proj.weight" in got.missing_keys
    assert "gate_proj.weight" not in got.unexpected_keys
    with pytest.raises(RuntimeError, match=r"up_proj\.weight"):
        mlp.load_state_dict({"gate_proj.weight": torch.zeros(24, 16), "down_proj.weight": torch.zeros(16, 24)})
