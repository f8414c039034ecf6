"""A `kvcache` node split across a rank group: rank 0 decides every step once, every rank runs it on its shard.

Rank 0 is the engine the server talks to: admission, batching, chunked prefill, preemption,
prefix-cache hits, forks and labels, and sampling all happen there alone. Before each forward it
sends the step (`step_message.py`) to the other ranks; so it does before each module call that runs
collectives outside the forward (`embed`, `compute_logits`, `compute_<name>`). A follower's engine
never schedules: it applies the page ops and runs the same calls on its own pool, which has the
same pages as rank 0's but holds only its own KV heads (so KV bytes per rank are ~1/N).

A cache that moves to another worker (per-walk placement) carries every rank's heads: an export
gathers each rank's rows of the label's pages to rank 0, which concatenates them in rank order (the
heads' order in the unsplit model); an import hands each rank its heads of the snapshot. So a snapshot
is the same whatever the group's size, and a cache moves between groups of any sizes (TP=2 to TP=2,
TP=2 to one process, one process to TP=2), as long as each rank holds a contiguous block of the heads.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mstar_core.errors import ConfigError
from mstar_core.runtime.rank_steps import RankGroup, RankMessage, group_broken
from mstar_kvcache.pool import PagePool
from mstar_kvcache.step_message import (
    CALL,
    GATHER,
    SCATTER,
    STEP,
    apply_page_ops,
    call_message,
    kv_message,
    read_step,
    step_message,
)

if TYPE_CHECKING:
    from mstar_kvcache.step_inputs import StepForward

log = logging.getLogger("mstar.kvcache.ranks")


class LeaderPagePool(PagePool):
    """Rank 0's pool: the page ops that change KV contents outside a forward are recorded for the followers."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.pending_ops: list[list[Any]] = []

    def copy(self, src: int) -> int:
        dst = super().copy(src)
        self.pending_ops.append(["copy", src, dst])
        return dst

    def take_ops(self) -> list[list[Any]]:
        ops, self.pending_ops = self.pending_ops, []
        return ops


class _BroadcastingModule:
    """Rank 0's view of the module: calls with collectives outside the forward go to the followers first."""

    def __init__(self, module: Any, leader: StepLeader):
        self.__dict__["_module"], self.__dict__["_leader"] = module, leader

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if name == "embed" or name.startswith("compute_"):
            return lambda x, _name=name, _fn=value: self._leader.call(_name, _fn, x)
        return value


def pool_class(group: RankGroup | None) -> type[PagePool]:
    """The pool a rank of `group` keeps: rank 0's records the page ops its followers must repeat."""
    return LeaderPagePool if group is not None and group.leader else PagePool


def split_shape(module: Any, group: RankGroup, node: str, kv_heads: int) -> int:
    """This rank's KV heads; a ConfigError naming the node unless its module was split over this group.

    (A module with its own `kv_cache_spec` gives this rank's heads: its snapshots count every rank's copy.)"""
    split = getattr(module, "tensor_parallel", None)
    if split is None or getattr(split, "world_size", 1) != group.world_size:
        raise ConfigError(f"node '{node}': module {type(module).__name__} was not split across the group's "
                          f"{group.world_size} ranks (it cannot be split, or its model does not load split "
                          "modules); place it on a worker without tensor_parallel")
    if hasattr(module, "kv_cache_spec"):
        return kv_heads  # a module's own spec gives this rank's shape
    try:  # `config` gives the whole model's: a rank holds its share, or the one head its query heads read
        return split.local_kv_heads(kv_heads)
    except ValueError:
        raise ConfigError(f"node '{node}': {kv_heads} KV heads neither split over nor replicate on "
                          f"{group.world_size} ranks") from None


def exit_if_broken(exc: BaseException, node: str, group: RankGroup) -> None:
    """Exit the process when `exc` says the rank group broke: its requests then fail as lost, at once."""
    if group_broken(exc):
        log.error("node '%s': rank %d's tensor-parallel group broke (%s); exiting so the server replaces the "
                  "group", node, group.rank, str(exc)[:200])
        os._exit(3)


class StepLeader:
    """Rank 0 of a split node: sends the followers every step and every module call they must run with it."""

    def __init__(self, group: RankGroup, pool: PagePool, node: str, kv_replicas: int = 1):
        self.group, self.pool, self.node = group, pool, node
        #: ranks holding each KV head (more than 1 where the ranks outnumber the model's KV heads): a snapshot
        #: takes one copy of each, and hands it back to every rank that holds it
        self.kv_replicas = kv_replicas
        self.forgotten: list[int] = []  # sequences whose backend state was dropped since the last message

    def module_view(self, module: Any) -> Any:
        """`module` as rank 0 calls it: `embed` and `compute_<name>` run on every rank."""
        return _BroadcastingModule(module, self)

    def pending_ops(self) -> list[list[Any]]:
        take = getattr(self.pool, "take_ops", None)
        ops = take() if take is not None else []
        ops.extend(["forget", seq_id] for seq_id in self.forgotten)
        self.forgotten.clear()
        return ops

    def send_step(self, ids: torch.Tensor | None, positions: torch.Tensor, batch: Any,
                  embeds: torch.Tensor | None, kwargs: dict[str, torch.Tensor]) -> None:
        header, tensors = step_message(self.group.key, self.pending_ops(), ids, positions, batch, embeds, kwargs)
        self.group.channel.send(header, tensors)

    def call(self, name: str, fn: Any, x: torch.Tensor) -> torch.Tensor:
        """Run the module's `name` (`fn`) on `x` here and on every follower."""
        return self._with_followers(*call_message(self.group.key, self.pending_ops(), name, x), lambda: fn(x))

    def gather_heads(self, pages: list[int], rows: int, local: torch.Tensor) -> torch.Tensor:
        """`local` (rank 0's rows of `pages`) with every other rank's heads of them, in rank order."""
        header = kv_message(self.group.key, self.pending_ops(), GATHER, pages, rows)
        return self._with_followers(header, None, lambda: gather_heads(local, self.group, self.kv_replicas))

    def scatter_heads(self, pages: list[int], rows: int, kv: torch.Tensor) -> torch.Tensor:
        """Hand each rank its heads of `kv` (every head, `rows` rows for `pages`); returns rank 0's."""
        header = kv_message(self.group.key, self.pending_ops(), SCATTER, pages, rows)
        kv = kv.to(self.pool.kv.device, self.pool.kv.dtype)
        return self._with_followers(header, None, lambda: scatter_heads(kv, self.pool.empty_rows(rows), self.group,
                                                                        self.kv_replicas))

    def _with_followers(self, header: dict[str, Any], tensors: dict[str, torch.Tensor] | None, run: Any) -> Any:
        """Send the followers `header`, then run rank 0's own side of what they do (a broken group exits)."""
        try:
            self.group.channel.send(header, tensors)
            return run()
        except Exception as exc:
            exit_if_broken(exc, self.node, self.group)
            raise


class StepFollower:
    """Another rank of a split node: never schedules; runs what rank 0 sent on its own pool, in the order it came."""

    def __init__(self, group: RankGroup, pool: PagePool, forward: StepForward, module: Any, device: torch.device,
                 node: str):
        self.group, self.pool, self.forward, self.module = group, pool, forward, module
        self.device, self.node = device, node

    def follow(self, msg: RankMessage) -> None:
        """Run one message from rank 0 (on the device thread)."""
        header = msg.header
        with torch.inference_mode():  # (a backend's per-sequence tensors were made in inference mode)
            try:
                apply_page_ops(self.pool.kv, self.forward.backend, header["ops"])
            except Exception:  # the step must still run: its collectives are what keeps the ranks in step
                log.exception("node '%s': rank %d could not apply rank 0's page ops", self.node, self.group.rank)
            if header["kind"] == STEP:
                self.forward.run_followed(*read_step(msg, self.pool.page_size, self.device))
            elif header["kind"] == CALL:
                getattr(self.module, header["method"])(msg.tensors["x"].to(self.device))
            elif header["kind"] == GATHER:
                gather_heads(self.pool.read_rows(header["pages"], header["rows"]), self.group)
            elif header["kind"] == SCATTER:
                self.pool.write_rows(header["pages"], scatter_heads(None, self.pool.empty_rows(header["rows"]),
                                                                    self.group))
            else:
                raise ValueError(f"unknown step message kind {header['kind']!r}")


def gather_heads(local: torch.Tensor, group: RankGroup, replicas: int = 1) -> torch.Tensor:
    """Every rank's `local` (`[layers, 2, rows, heads, dim]`) concatenated along the heads, on rank 0 (others: `local`);
    each replicated head once (the first of every `replicas` ranks holds it)."""
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(group.world_size)] if group.leader else None
    dist.gather(local, parts, dst=0, group=group.channel.process_group)
    return torch.cat(parts[::replicas], dim=3) if parts is not None else local


def scatter_heads(kv: torch.Tensor | None, out: torch.Tensor, group: RankGroup, replicas: int = 1) -> torch.Tensor:
    """Rank 0 splits `kv` along the heads into rank-order blocks; every rank gets its own into `out` (a replicated
    head goes to each of its `replicas` ranks)."""
    blocks = [part.contiguous() for part in kv.chunk(group.world_size // replicas, dim=3)] if group.leader else None
    parts = [blocks[rank // replicas] for rank in range(group.world_size)] if blocks is not None else None
    dist.scatter(out, parts, src=0, group=group.channel.process_group)
    return out
