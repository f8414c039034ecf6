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

_GROUPED_MM_WORKS: dict[tuple[str, torch.dtype], bool] = {}


def _grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `F.grouped_mm` runs on this device and dtype (probed once; CUDA kernels need bf16 on sm80+)."""
    key = (device.type, dtype)
    if key not in _GROUPED_MM_WORKS:
        ok = hasattr(F, "grouped_mm") and dtype in (torch.float32, torch.bfloat16, torch.float16)
        if ok:
            try:
                a = torch.ones(8, 16, device=device, dtype=dtype)
                b = torch.ones(2, 16, 16, device=device, dtype=dtype)
                offs = torch.tensor([3, 8], device=device, dtype=torch.int32)
                F.grouped_mm(a, b.transpose(1, 2), offs=offs)
            except (RuntimeError, NotImplementedError):
                ok = False
        _GROUPED_MM_WORKS[key] = ok
    return _GROUPED_MM_WORKS[key]


class FusedExperts(nn.Module):
    """E gated MLPs stored as stacked weights; each expert runs on the tokens routed to it.

    No host sync: the (token, slot) pairs are sorted by expert and each expert's segment runs as
    one grouped GEMM (`F.grouped_mm`, segment ends as a device tensor), so nothing about the
    routing is read back to Python and the forward is a fixed sequence of kernels (CUDA-graph
    capturable). Where grouped GEMMs cannot run (dtype, or rows not 16-byte aligned) every expert
    runs on every token and the chosen outputs are gathered: exact, also sync-free, but E/k times
    the work, so only for small test shapes.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str = "silu", *,
                 first_expert: int = 0, total_experts: int | None = None):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        # expert parallelism: this module holds experts [first_expert, first_expert + num_experts) of total_experts;
        # slots routed elsewhere contribute zero (another rank's partial sum holds them)
        self.first_expert = first_expert
        self.total_experts = num_experts if total_experts is None else total_experts
        self.act = activation(act)

    @property
    def holds_all(self) -> bool:
        return self.num_experts == self.total_experts

    def _grouped(self, x: torch.Tensor) -> bool:
        size = x.element_size()
        aligned = (self.hidden * size) % 16 == 0 and (self.intermediate * size) % 16 == 0
        return aligned and x.dtype == self.gate_up_proj.dtype and _grouped_mm_works(x.device, x.dtype)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`x` `[T, H]`, `experts`/`weights` `[T, k]` -> weighted sum of the chosen experts' outputs."""
        t, k = experts.shape
        mine = None
        if not self.holds_all:  # local ids; a slot of another rank's expert sorts after every local one
            experts = experts - self.first_expert
            mine = (experts >= 0) & (experts < self.num_experts)
            experts = experts.masked_fill(~mine, self.num_experts)
        if not self._grouped(x):
            return self._dense(x, experts, weights, mine)
        flat = experts.reshape(-1)
        by_expert, order = flat.sort(stable=True)  # slot i*k+j of token i, grouped by expert
        # segment ends: slots routed to experts 0..e
        ends = torch.searchsorted(by_expert, torch.arange(self.num_experts, device=x.device), right=True, out_int32=True)
        rows = x.index_select(0, order // k)
        h = F.grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offs=ends)
        gate, up = h.split(self.intermediate, dim=-1)
        y = F.grouped_mm(self.act(gate) * up, self.down_proj.transpose(1, 2), offs=ends)
        per_slot = torch.empty_like(y).index_copy_(0, order, y).view(t, k, -1)  # back to (token, slot)
        if mine is not None:  # rows past the last local segment are left unwritten by grouped_mm: select, not scale
            per_slot = torch.where(mine[..., None], per_slot, 0.0)
        return (per_slot * weights.to(y.dtype)[..., None]).sum(dim=1)

    def _dense(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
               mine: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.einsum("th,eoh->eto", x, self.gate_up_proj)
        gate, up = h.split(self.intermediate, dim=-1)
        y = torch.einsum("eti,ehi->eth", self.act(gate) * up, self.down_proj)  # [E, T, H]
        index = experts if mine is None else experts.clamp(max=self.num_experts - 1)
        chosen = y[index, torch.arange(x.shape[0], device=x.device)[:, None]]  # [T, k, H]
        if mine is not None:
            chosen = torch.where(mine[..., None], chosen, 0.0)
        return (chosen * weights.to(y.dtype)[..., None]).sum(dim=1)


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
