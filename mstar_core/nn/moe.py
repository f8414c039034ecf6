"""Top-k mixture-of-experts feed-forward with expert weights fused into stacked tensors.

Checkpoints store one module per expert (`mlp.experts.E.{gate,up,down}_proj.weight`); the loader
fuses them (see `mstar_core.checkpoint.mapping.ExpertFusion`) into `experts.gate_up_proj`
`[E, 2I, H]` and `experts.down_proj` `[E, H, I]`, so the block holds three tensors, not 3E modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.nn.mlp import GatedMLP, activation


class FusedExperts(nn.Module):
    """E gated MLPs stored as stacked weights; runs each expert on the tokens routed to it."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str = "silu"):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.intermediate = intermediate
        self.act = activation(act)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`x` `[T, H]`, `experts`/`weights` `[T, k]` -> weighted sum of the chosen experts' outputs."""
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():
            token_idx, slot = torch.nonzero(experts == e, as_tuple=True)
            h = F.linear(x[token_idx], self.gate_up_proj[e])
            gate, up = h.split(self.intermediate, dim=-1)
            y = F.linear(self.act(gate) * up, self.down_proj[e])
            out.index_add_(0, token_idx, y * weights[token_idx, slot, None].to(y.dtype))
        return out


class TopKMoE(nn.Module):
    """Router (`gate`) picks `top_k` experts per token from a softmax; optional shared expert (Qwen2-MoE)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool = True,
        act: str = "silu",
        shared_intermediate: int | None = None,
    ):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k ({top_k}) must be in 1..num_experts ({num_experts})")
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, hidden, intermediate, act)
        self.shared_expert = GatedMLP(hidden, shared_intermediate, act) if shared_intermediate else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_intermediate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(x, experts, weights.to(x.dtype))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
