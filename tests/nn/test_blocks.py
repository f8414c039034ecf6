"""Building blocks against transformers' implementations and exact invariants."""

from __future__ import annotations

import pytest
import torch

from mstar_core.checkpoint import ExpertFusion, RuleMapping, load_weights
from mstar_core.errors import ConfigError
from mstar_core.nn import LlamaConfig, RotaryEmbedding, TopKMoE, apply_rotary, rope_parameters

transformers = pytest.importorskip("transformers")


class DictSource:
    """In-memory tensor source for loader tests."""

    def __init__(self, tensors):
        self.tensors, self.where = dict(tensors), "<memory>"

    def __len__(self):
        return len(self.tensors)

    def items(self):
        return iter(self.tensors.items())


@pytest.mark.parametrize("norm_topk", [True, False])
def test_moe_fused_from_per_expert_checkpoint_matches_transformers(norm_topk):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=6,
                                      num_experts_per_tok=2, norm_topk_prob=norm_topk)
    torch.manual_seed(0)
    ref = Qwen3MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.2)
    # Write the checkpoint the way it is published: one module per expert.
    ckpt = {"mlp.gate.weight": ref.gate.weight.detach().clone()}
    for e in range(6):
        gate, up = ref.experts.gate_up_proj[e].detach().chunk(2, dim=0)
        ckpt[f"mlp.experts.{e}.gate_proj.weight"] = gate.clone()
        ckpt[f"mlp.experts.{e}.up_proj.weight"] = up.clone()
        ckpt[f"mlp.experts.{e}.down_proj.weight"] = ref.experts.down_proj[e].detach().clone()
    with torch.device("meta"):
        ours = TopKMoE(32, 16, num_experts=6, top_k=2, norm_topk_prob=norm_topk)
    mapping = RuleMapping(rename=[(r"^mlp\.", "")], fuse=ExpertFusion(6))
    load_weights(ours, DictSource(ckpt), mapping, progress=False)
    x = torch.randn(11, 32)
    with torch.no_grad():
        want = ref(x[None])
        want = want[0] if isinstance(want, torch.Tensor) else want[0][0]
        torch.testing.assert_close(ours(x), want, atol=1e-5, rtol=1e-5)


def test_expert_fusion_names_missing_expert():
    from mstar_core.checkpoint import CheckpointError

    mapping = RuleMapping(fuse=ExpertFusion(2))
    list(mapping("l.experts.0.gate_proj.weight", torch.zeros(2, 2)))
    with pytest.raises(CheckpointError, match=r"l\.experts\.1\.gate_proj\.weight"):
        list(mapping.flush())


def test_llama3_rope_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, rope_theta=5e5, rope_scaling={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = RotaryEmbedding(64, rope_parameters(cfg.to_dict()))
    torch.testing.assert_close(ours.inv_freq, want.float(), atol=0, rtol=1e-6)


def test_rotary_preserves_norm_and_relative_positions():
    rope = RotaryEmbedding(16, {"rope_type": "default", "rope_theta": 10000.0})
    q, k = torch.randn(1, 2, 16), torch.randn(1, 2, 16)
    dots = []
    for shift in (0, 7, 100):
        cq, sq = rope(torch.tensor([3 + shift]))
        ck, sk = rope(torch.tensor([1 + shift]))
        rq, rk = apply_rotary(q, cq, sq), apply_rotary(k, ck, sk)
        torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
        dots.append((rq * rk).sum(-1))
    torch.testing.assert_close(dots[0], dots[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dots[0], dots[2], atol=1e-4, rtol=1e-4)


BASE = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)


@pytest.mark.parametrize(
    ("patch", "key"),
    [
        ({"hidden_size": None}, "hidden_size"),
        ({"hidden_size": "8"}, "hidden_size"),
        ({"num_key_value_heads": 3, "num_attention_heads": 4}, "num_attention_heads"),
        ({"hidden_act": "swoosh"}, "hidden_act"),
        ({"model_type": "gpt2"}, "model_type"),
        ({"rope_scaling": {"rope_type": "yarnish", "factor": 2.0}}, "rope_scaling"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 2.0}}, "low_freq_factor"),
        ({"tie_word_embeddings": 1}, "tie_word_embeddings"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ],
)
def test_config_errors_name_the_key(patch, key):
    cfg = {**BASE, **patch}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(ConfigError, match=key):
        LlamaConfig.from_hf(cfg)


def test_config_defaults():
    cfg = LlamaConfig.from_hf({**BASE, "model_type": "qwen2", "eos_token_id": [3, 4]})
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.qkv_bias, cfg.o_bias) == (4, 2, True, False)
    assert cfg.eos_token_ids == (3, 4)


def test_layernorm_and_gelu_mlp_match_torch_references():
    from mstar_core.nn import MLP, LayerNorm, RMSNorm

    torch.manual_seed(0)
    x = torch.randn(5, 16)
    ln = LayerNorm(16)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    ref = torch.nn.LayerNorm(16)
    ref.load_state_dict(ln.state_dict())
    torch.testing.assert_close(ln(x), ref(x))
    mlp = MLP(16, 32, act="gelu_pytorch_tanh")
    want = mlp.fc2(torch.nn.functional.gelu(mlp.fc1(x), approximate="tanh"))
    torch.testing.assert_close(mlp(x), want)
    rms = RMSNorm(16, eps=1e-6)
    torch.testing.assert_close(rms(x), torch.nn.functional.rms_norm(x, (16,), rms.weight, 1e-6))
