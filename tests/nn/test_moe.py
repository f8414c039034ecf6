"""Top-k MoE without host syncs: equal to a per-expert loop and to transformers' blocks, and reads nothing back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mstar_core.nn import TopKMoE

transformers = pytest.importorskip("transformers")


def per_expert_loop(moe: TopKMoE, x: torch.Tensor) -> torch.Tensor:
    """The module as it was: route, then a Python loop over the experts that were hit."""
    probs = F.softmax(moe.gate(x).float(), dim=-1)
    weights, experts = probs.topk(moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    ex, inter = moe.experts, moe.experts.intermediate
    out = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():
        token_idx, slot = torch.nonzero(experts == e, as_tuple=True)
        gate, up = F.linear(x[token_idx], ex.gate_up_proj[e]).split(inter, dim=-1)
        y = F.linear(ex.act(gate) * up, ex.down_proj[e])
        out.index_add_(0, token_idx, y * weights[token_idx, slot, None].to(y.dtype))
    if moe.shared_expert is not None:
        out = out + torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
    return out


def _random_moe(hidden, inter, experts, k, shared=None, norm=True, seed=0):
    torch.manual_seed(seed)
    moe = TopKMoE(hidden, inter, num_experts=experts, top_k=k, norm_topk_prob=norm, shared_intermediate=shared)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
    return moe.eval()


# (hidden, intermediate, experts, top_k): aligned shapes take the grouped-GEMM path, 30/10 the dense fallback
SHAPES = [(32, 16, 6, 2), (64, 32, 16, 4), (64, 24, 128, 8), (30, 10, 6, 2)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_equals_the_per_expert_loop(shape, tokens):
    moe = _random_moe(*shape, shared=shape[1] if tokens == 7 else None)
    assert moe.experts._grouped(torch.zeros(1, shape[0])) == (shape[0] % 4 == 0 and shape[1] % 4 == 0)
    x = torch.randn(tokens, shape[0])
    with torch.no_grad():
        torch.testing.assert_close(moe(x), per_expert_loop(moe, x), atol=1e-5, rtol=1e-5)


def test_dense_fallback_equals_grouped():
    moe = _random_moe(32, 16, 8, 3)
    x = torch.randn(19, 32)
    with torch.no_grad():
        probs = F.softmax(moe.gate(x), dim=-1)
        weights, experts = probs.topk(3, dim=-1)
        torch.testing.assert_close(moe.experts._dense(x, experts, weights), moe.experts(x, experts, weights),
                                   atol=1e-5, rtol=1e-5)


def test_equals_qwen3_omni_talker_block_with_shared_expert():
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTalkerTextConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeTalkerTextSparseMoeBlock,
    )

    cfg = Qwen3OmniMoeTalkerTextConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                                       shared_expert_intermediate_size=24, norm_topk_prob=False, hidden_act="silu")
    torch.manual_seed(0)
    ref = Qwen3OmniMoeTalkerTextSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.2)
    with torch.device("meta"):
        ours = TopKMoE(32, 16, num_experts=8, top_k=2, norm_topk_prob=False, shared_intermediate=24)
    ours.load_state_dict(ref.state_dict(), strict=True, assign=True)  # same names; shared expert's gate/up fused
    x = torch.randn(13, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x[None])[0], atol=1e-5, rtol=1e-5)


class _HostReads(TorchDispatchMode):
    """Records ops that read device data back to the host or have data-dependent output shapes."""

    SYNCING = ("_local_scalar_dense", "nonzero", "unique", "masked_select", "bincount", "item")

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if any(name.startswith(s) or name.startswith("_" + s) for s in self.SYNCING):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("shape", [(64, 24, 128, 8), (30, 10, 6, 2)], ids=["grouped", "dense"])
def test_forward_never_reads_back_to_the_host(shape, monkeypatch):
    moe = _random_moe(*shape, shared=16)
    x = torch.randn(9, shape[0])

    def refuse(*args, **kwargs):
        raise AssertionError("the MoE forward read a tensor back to the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    with torch.no_grad(), _HostReads() as reads:
        moe(x)
    monkeypatch.undo()
    assert reads.seen == []
    # the check itself catches the old loop
    with torch.no_grad(), _HostReads() as reads:
        per_expert_loop(moe, x)
    assert reads.seen
