"""A split layer's collectives as opaque ops (`mstar_nn::all_reduce`, `mstar_nn::all_gather_last`) for compiled graphs.

Under `torch.compile` (a `kvcache` node's compiled steps) dynamo would otherwise trace
`torch.distributed` calls, or break the graph at each of them (two breaks per layer). As one opaque op
each, a compiled step stays one graph per bucket: inductor fuses the elementwise work around the
collective and calls it as it is, the eager `torch.distributed` call. Every rank runs the same graph,
so the collectives line up across the ranks in the same order, with the same (bucket-padded) shapes.

Ops take plain arguments only, so a process group travels by name: "" is the default group, any other
group is registered here (`group_key`) when a layer first asks for it.

On CUDA a compiled step's pieces replay as CUDA graphs; the collectives are marked cudagraph-unsafe,
like the kvcache engine's attention op, so they run eagerly between the replayed pieces instead of being
captured (NCCL collectives under capture need care this was not tested with: no multi-GPU machine here).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_GROUPS: dict[str, dist.ProcessGroup] = {}
_UNSAFE = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


def group_key(process_group: dist.ProcessGroup | None) -> str:
    """The name the ops find `process_group` by ("" for the default group)."""
    if process_group is None:
        return ""
    name = process_group.group_name
    _GROUPS.setdefault(name, process_group)
    return name


def _group(key: str) -> dist.ProcessGroup | None:
    return _GROUPS[key] if key else None


@torch.library.custom_op("mstar_nn::all_reduce", mutates_args=(), tags=_UNSAFE)
def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """The sum of `x` over the ranks of `group`, as a new tensor."""
    out = x.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=_group(group))
    return out


@all_reduce.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("mstar_nn::all_gather_last", mutates_args=(), tags=_UNSAFE)
def all_gather_last(x: torch.Tensor, world_size: int, group: str) -> torch.Tensor:
    """Every rank's `x` of `group`, concatenated along the last dim in rank order."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x, group=_group(group))
    return torch.cat(parts, dim=-1)


@all_gather_last.register_fake
def _(x: torch.Tensor, world_size: int, group: str) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], x.shape[-1] * world_size)
