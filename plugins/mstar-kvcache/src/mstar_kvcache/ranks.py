"""A `kvcache` node split across a rank group: rank 0 decides every step once, every rank runs it on its shard.

Rank 0 is the engine the server talks to: admission, batching, chunked prefill, preemption,
prefix-cache hits, forks and labels, and sampling all happen there alone. Before each forward it
sends the step (`step_message.py`) to the other ranks; so it does before each module call that runs
collectives outside the forward (`embed`, `compute_logits`, `compute_<name>`). A follower's engine
never schedules: it applies the page ops and runs the same calls on its own pool, which has the
same pages as rank 0's but holds only its own KV heads (so KV bytes per rank are ~1/N).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from mstar_core.errors import ConfigError
from mstar_core.runtime.rank_steps import RankGroup, RankMessage, group_broken
from mstar_kvcache.pool import PagePool
from mstar_kvcache.step_message import CALL, STEP, apply_page_ops, call_message, read_step, step_message

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
        header, tensors = call_message(self.ranks.key, self._pending_ops(), name, x)
        try:
            self.ranks.channel.send(header, tensors)
            return fn(x)
        except Exception as exc:
            self._check_group(exc)
            raise

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
            else:
                raise ValueError(f"unknown step message kind {header['kind']!r}")
