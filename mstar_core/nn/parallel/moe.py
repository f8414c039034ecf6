"""A top-k mixture of experts split over a group: whole experts per rank (expert parallel) or each expert's columns.

The router is replicated, so every rank picks the same experts for every token. Expert parallel: a rank
holds `E / N` experts and runs only the (token, slot) pairs routed to them; tensor parallel: a rank holds
`I / N` intermediate columns of every expert. Either way each rank's output is a partial sum (other
ranks hold the other experts or columns) and one all-reduce per layer completes it, the shared expert's
partial sum (split by columns) included. Routing by all-reduce moves `T x H` per rank where an
all-to-all dispatch would move only the routed rows; on CPU over gloo (and at decode's few rows) that
is the simpler and no slower collective, and the result is the same sum.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar_core.nn.mlp import GatedMLP
from mstar_core.nn.moe import FusedExperts, TopKMoE
from mstar_core.nn.parallel.group import TensorParallelGroup
from mstar_core.nn.parallel.slices import Piece, Stack


class ParallelMoE(nn.Module):
    """This rank's share of a `TopKMoE` (same parameter names); `forward` returns the full sum on every rank."""

    def __init__(self, moe: TopKMoE, group: TensorParallelGroup, *, expert_parallel: bool):
        super().__init__()
        full = moe.experts
        n = group.world_size
        self.group, self.expert_parallel = group, expert_parallel
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate = nn.Linear(full.hidden, full.num_experts, bias=False)  # the router, replicated
        if expert_parallel:
            first, stop = group.shard(full.num_experts)
            self.experts = FusedExperts(stop - first, full.hidden, full.intermediate, first_expert=first,
                                        total_experts=full.num_experts)
        else:
            self.experts = FusedExperts(full.num_experts, full.hidden, full.intermediate // n)
        self.experts.act = full.act
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert is not None:
            shared = moe.shared_expert
            local = shared.intermediate // n
            self.shared_expert = GatedMLP(full.hidden, local)
            self.shared_expert.act = shared.act
            # the down projection's partial sum joins the experts' before the one all-reduce
            self.shared_expert.down_proj = nn.Linear(local, full.hidden, bias=False)
            self.shared_expert_gate = nn.Linear(full.hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the same routing as the whole layer (same attribute names), over this rank's share, then one all-reduce
        return self.group.all_reduce(TopKMoE.forward(self, x))

    def extra_repr(self) -> str:
        e = self.experts
        kind = (f"experts [{e.first_expert}, {e.first_expert + e.num_experts}) of {e.total_experts}"
                if self.expert_parallel else f"intermediate {e.intermediate} of every expert")
        return f"{kind}, rank={self.group.rank}/{self.group.world_size}"


def moe_entries(moe: ParallelMoE, ckpt: str, group: TensorParallelGroup, full_intermediate: int,
                shared_intermediate: int | None) -> dict[str, list[Piece] | Stack]:
    """Plan entries (names relative to the MoE) reading this rank's experts from per-expert checkpoint tensors.

    `ckpt` is the MoE's checkpoint prefix (`...mlp.`); experts are stored `experts.E.{gate,up,down}_proj.weight`.
    """
    e = moe.experts
    experts = f"{ckpt}experts."
    if moe.expert_parallel:
        ids, (i0, i1) = range(e.first_expert, e.first_expert + e.num_experts), (0, full_intermediate)
    else:
        ids, (i0, i1) = range(e.num_experts), group.shard(full_intermediate)
    out: dict[str, list[Piece] | Stack] = {
        "gate.weight": [Piece(f"{ckpt}gate.weight")],
        "experts.gate_up_proj": Stack(tuple((Piece(f"{experts}{x}.gate_proj.weight", 0, i0, i1),
                                             Piece(f"{experts}{x}.up_proj.weight", 0, i0, i1)) for x in ids)),
        "experts.down_proj": Stack(tuple((Piece(f"{experts}{x}.down_proj.weight", 1, i0, i1),) for x in ids)),
    }
    if shared_intermediate:
        s0, s1 = group.shard(shared_intermediate)
        shared = f"{ckpt}shared_expert."
        out["shared_expert.gate_up_proj.weight"] = [Piece(f"{shared}gate_proj.weight", 0, s0, s1),
                                                    Piece(f"{shared}up_proj.weight", 0, s0, s1)]
        out["shared_expert.down_proj.weight"] = [Piece(f"{shared}down_proj.weight", 1, s0, s1)]
        out["shared_expert_gate.weight"] = [Piece(f"{ckpt}shared_expert_gate.weight")]
    return out
