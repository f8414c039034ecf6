"""`TensorParallelGroup`: the ranks one node is split across, and the two collectives its layers need."""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist

from mstar_core.nn.parallel import collectives  # (registers the mstar_nn collective ops)


@attrs.frozen
class TensorParallelGroup:
    """This process's rank in a group of `world_size` ranks; `process_group` None means the default group.

    A size-1 group (`TensorParallelGroup.single()`) runs no collective at all, so an unsplit node pays
    nothing and needs no `torch.distributed` set-up. Collectives are inference-only (not differentiable).
    """

    rank: int
    world_size: int
    process_group: dist.ProcessGroup | None = None
    #: how mixture-of-experts layers split over these ranks: whole experts per rank (a worker's
    #: `expert_parallel: N`) or every expert's intermediate columns (`tensor_parallel: N`); other layers
    #: split by heads and columns either way
    expert_parallel: bool = attrs.field(default=False, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.world_size}")

    @classmethod
    def single(cls) -> TensorParallelGroup:
        """The trivial group: one rank, no collectives."""
        return cls(0, 1)

    @classmethod
    def from_process_group(cls, process_group: dist.ProcessGroup | None = None, *,
                           expert_parallel: bool = False) -> TensorParallelGroup:
        """This process's place in `process_group` (the default group when None); needs `init_process_group` first."""
        return cls(dist.get_rank(process_group), dist.get_world_size(process_group), process_group,
                   expert_parallel=expert_parallel)

    def shard(self, total: int) -> tuple[int, int]:
        """This rank's `[start, stop)` of `total` items split evenly (the caller checked divisibility)."""
        if total % self.world_size:
            raise ValueError(f"{total} does not split over {self.world_size} ranks")
        size = total // self.world_size
        return self.rank * size, (self.rank + 1) * size

    def kv_shard(self, kv_heads: int) -> tuple[int, int]:
        """This rank's `[start, stop)` of `kv_heads` KV heads: split evenly when the ranks divide them; when the
        ranks outnumber them (a multiple of them), the one KV head this rank's query heads read, replicated on
        `world_size / kv_heads` ranks (as vLLM does: a model with one KV head still splits its query heads)."""
        if kv_heads % self.world_size == 0:
            return self.shard(kv_heads)
        if self.world_size % kv_heads:
            raise ValueError(f"{kv_heads} KV heads neither split over nor replicate on {self.world_size} ranks")
        head = self.rank // (self.world_size // kv_heads)  # ranks r*n/kv..: query heads of KV head r // (n / kv)
        return head, head + 1

    def local_kv_heads(self, kv_heads: int) -> int:
        """How many KV heads a rank holds (and caches): its share, or the one replicated head."""
        start, stop = self.kv_shard(kv_heads)
        return stop - start

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place (compiled: into a new tensor); use what it returns."""
        if self.world_size > 1:
            if torch.compiler.is_compiling():  # one opaque op, not a traced or graph-breaking collective
                return torch.ops.mstar_nn.all_reduce(tensor, collectives.group_key(self.process_group))
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group)
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `tensor` along the last dim, in rank order."""
        if self.world_size == 1:
            return tensor
        if torch.compiler.is_compiling():
            return torch.ops.mstar_nn.all_gather_last(tensor, self.world_size,
                                                        collectives.group_key(self.process_group))
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.process_group)
        return torch.cat(parts, dim=-1)
