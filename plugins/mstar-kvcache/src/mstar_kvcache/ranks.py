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
from typing import Any

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

    def __init__(self, module: Any, engine: Any):
        self.__dict__["_module"], self.__dict__["_engine"] = module, engine

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if name == "embed" or name.startswith("compute_"):
            return lambda x, _name=name, _fn=value: self._engine._leader_call(_name, _fn, x)
        return value


def split_shape(module: Any, group: RankGroup, node: str, kv_heads: int) -> int:
    """This rank's KV heads; a ConfigError naming the node unless its module was split over this group."""
    split = getattr(module, "tensor_parallel", None)
    if split is None or getattr(split, "world_size", 1) != group.world_size:
        raise ConfigError(f"node '{node}': module {type(module).__name__} was not split across the group's "
                          f"{group.world_size} ranks (it cannot be split, or its model does not load split "
                          "modules); place it on a worker without tensor_parallel")
    if hasattr(module, "kv_cache_spec"):
        return kv_heads  # a module's own spec gives this rank's shape
    if kv_heads % group.world_size:
        raise ConfigError(f"node '{node}': {kv_heads} KV heads do not split over {group.world_size} ranks")
    return kv_heads // group.world_size  # `config` gives the whole model's


class RankSteps:
    """Mixin of `KVCacheEngine`: the rank-group side of a split node (nothing happens when `ranks` is None)."""

    ranks: RankGroup | None

    def _pool_class(self) -> type[PagePool]:
        return LeaderPagePool if self.ranks is not None and self.ranks.leader else PagePool

    def _lead(self) -> None:
        """Rank 0: route the module's out-of-forward collectives through the followers."""
        self.module = _BroadcastingModule(self.module, self)

    def _pending_ops(self) -> list[list[Any]]:
        take = getattr(self.pool, "take_ops", None)
        ops = take() if take is not None else []
        ops.extend(["forget", seq_id] for seq_id in self._forgotten)
        self._forgotten.clear()
        return ops

    def _send_step(self, ids: torch.Tensor | None, positions: torch.Tensor, batch: Any,
                   embeds: torch.Tensor | None, kwargs: dict[str, torch.Tensor]) -> None:
        header, tensors = step_message(self.ranks.key, self._pending_ops(), ids, positions, batch, embeds, kwargs)
        self.ranks.channel.send(header, tensors)

    def _leader_call(self, name: str, fn: Any, x: torch.Tensor) -> torch.Tensor:
        return self._with_followers(*call_message(self.ranks.key, self._pending_ops(), name, x), lambda: fn(x))

    def _gather_heads(self, pages: list[int], rows: int, local: torch.Tensor) -> torch.Tensor:
        """Rank 0: `local` (its rows of `pages`) with every other rank's heads of them, in rank order."""
        header = kv_message(self.ranks.key, self._pending_ops(), GATHER, pages, rows)
        return self._with_followers(header, None, lambda: gather_heads(local, self.ranks))

    def _scatter_heads(self, pages: list[int], rows: int, kv: torch.Tensor) -> torch.Tensor:
        """Rank 0: hand each rank its heads of `kv` (every head, `rows` rows for `pages`); returns rank 0's."""
        header = kv_message(self.ranks.key, self._pending_ops(), SCATTER, pages, rows)
        kv = kv.to(self.pool.kv.device, self.pool.kv.dtype)
        return self._with_followers(header, None, lambda: scatter_heads(kv, self._kv_rows(rows), self.ranks))

    def _with_followers(self, header: dict[str, Any], tensors: dict[str, torch.Tensor] | None, run: Any) -> Any:
        """Rank 0: send the followers `header`, then run its own side of what they do (a broken group exits)."""
        try:
            self.ranks.channel.send(header, tensors)
            return run()
        except Exception as exc:
            self._check_group(exc)
            raise

    def _kv_rows(self, rows: int) -> torch.Tensor:
        """An empty `[layers, 2, rows, this rank's kv_heads, head_dim]` for this rank's share of a moved cache."""
        layers, _, _, _, heads, dim = self.pool.kv.shape
        return self.pool.kv.new_empty(layers, 2, rows, heads, dim)

    def _check_group(self, exc: BaseException) -> None:
        """Exit the process when `exc` says the rank group broke: its requests then fail as lost, at once."""
        if group_broken(exc):
            log.error("node '%s': rank %d's tensor-parallel group broke (%s); exiting so the server replaces the "
                      "group", self.node.name, self.ranks.rank, str(exc)[:200])
            os._exit(3)

    def follow(self, msg: RankMessage) -> None:
        """A follower: run what rank 0 sent (on the device thread, in the order it came)."""
        header = msg.header
        with torch.inference_mode():  # (a backend's per-sequence tensors were made in inference mode)
            try:
                apply_page_ops(self.pool.kv, self.backend, header["ops"])
            except Exception:  # the step must still run: its collectives are what keeps the ranks in step
                log.exception("node '%s': rank %d could not apply rank 0's page ops", self.node.name, self.ranks.rank)
            if header["kind"] == STEP:
                ids, positions, batch, embeds, kwargs = read_step(msg, self.pool.page_size, self.device)
                context = self.backend.begin(batch, self.pool.kv)
                if embeds is None:
                    self.forward_fn(ids, positions, context, **kwargs)
                else:
                    self.forward_fn(None, positions, context, input_embeds=embeds, **kwargs)
            elif header["kind"] == CALL:
                getattr(self.module, header["method"])(msg.tensors["x"].to(self.device))
            elif header["kind"] == GATHER:
                gather_heads(self._read_kv(header["pages"], header["rows"]), self.ranks)
            elif header["kind"] == SCATTER:
                self._write_kv(header["pages"], scatter_heads(None, self._kv_rows(header["rows"]), self.ranks))
            else:
                raise ValueError(f"unknown step message kind {header['kind']!r}")


def gather_heads(local: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """Every rank's `local` (`[layers, 2, rows, heads, dim]`) concatenated along the heads, on rank 0 (others: `local`)."""
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(group.world_size)] if group.leader else None
    dist.gather(local, parts, dst=0, group=group.channel.process_group)
    return torch.cat(parts, dim=3) if parts is not None else local


def scatter_heads(kv: torch.Tensor | None, out: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """Rank 0 splits `kv` along the heads into rank-order blocks; every rank gets its own into `out`."""
    parts = [part.contiguous() for part in kv.chunk(group.world_size, dim=3)] if group.leader else None
    dist.scatter(out, parts, src=0, group=group.channel.process_group)
    return out
