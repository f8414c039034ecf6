"""Tensor-parallel worker groups as the server sees them: their members, their rendezvous, their set-up.

A worker with `tensor_parallel: N` is, per replica, N worker processes: the replica's own name is
rank 0 (the one invocations go to) and `<replica>.rank<i>` the followers. They join one
torch.distributed group through a TCPStore this server hosts on loopback (torch's store has no
authentication, so it listens on loopback only, like the `nccl` transport's). Each start of a group
(the first one and every replacement) rendezvous under a fresh prefix, so a replaced group never
meets a rank of the group before it.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterable
from typing import Any

import attrs
import torch.distributed as dist

from mstar_core.config.placement import WorkerSpec
from mstar_core.errors import ConfigError
from mstar_core.wire import LoadModel

#: How long ranks wait for each other at the rendezvous and in a collective before giving up.
RENDEZVOUS_TIMEOUT_S = 60.0


class RankGroups:
    """Every rank group of one `Cluster`: member names, each group's generation, the rendezvous store."""

    def __init__(self) -> None:
        self._members: dict[str, tuple[str, ...]] = {}
        self._generation: dict[tuple[str, ...], int] = {}
        self._whole_experts: set[tuple[str, ...]] = set()  # groups of an `expert_parallel` worker
        self._store: Any = None
        self._store_port = 0

    def register(self, names: Iterable[str], expert_parallel: bool = False) -> tuple[str, ...]:
        group = tuple(names)
        if expert_parallel:
            self._whole_experts.add(group)
        for name in group:
            self._members[name] = group
        self._generation.setdefault(group, 0)
        return group

    def group_of(self, worker: str) -> tuple[str, ...] | None:
        """All ranks of the group `worker` belongs to (rank 0 first), or None for an ordinary worker."""
        return self._members.get(worker)

    def renew(self, group: tuple[str, ...]) -> None:
        """A new start of `group`: its next loads rendezvous under a new prefix."""
        self._generation[group] += 1

    def setup(self, group: tuple[str, ...], rank: int, device: str) -> dict[str, Any]:
        """What rank `rank` of `group` needs to join it (the `tensor_parallel` field of its `LoadModel`)."""
        return {"rank": rank, "size": len(group), "store": f"127.0.0.1:{self._port()}",
                "prefix": f"{group[0]}#{self._generation[group]}", "timeout_s": RENDEZVOUS_TIMEOUT_S,
                "backend": "nccl" if device.startswith("cuda") else "gloo",
                "expert_parallel": group in self._whole_experts}

    def load_message(self, msg: LoadModel, group: tuple[str, ...], rank: int, device: str) -> LoadModel:
        """`msg` for one rank: its device and its place in the group's current start."""
        return attrs.evolve(msg, device=device, tensor_parallel=self.setup(group, rank, device))

    def _port(self) -> int:
        if self._store is None:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind(("127.0.0.1", 0))
            listener.listen(64)
            timeout = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
            self._store_port = listener.getsockname()[1]
            try:
                self._store = dist.TCPStore("127.0.0.1", self._store_port, is_master=True, timeout=timeout,
                                            wait_for_workers=False, master_listen_fd=listener.fileno())
            except BaseException:
                listener.close()
                raise
            listener.detach()  # the store owns the listening socket now, and closes it with itself
        return self._store_port

    def close(self) -> None:
        self._store = None


def check_rank_group(source: str, spec: WorkerSpec, graph: Any, nodes: list[str], engines: Any) -> None:
    """A ConfigError naming the node unless every node placed on `spec`'s group can be split over its ranks."""
    size = spec.group_size
    for name in nodes:
        node = graph.nodes[name]
        engine = engines.get(node.engine)
        if not hasattr(engine, "follow"):
            raise ConfigError(f"{source}: node '{name}' runs on the '{node.engine}' engine, which cannot run a node "
                              f"split across ranks; place it on a worker without tensor_parallel")
        check_splits(name, node.module() if node.module is not None else None, size, spec.expert_parallel > 1)


def check_splits(node: str, module: Any, size: int, expert_parallel: bool = False) -> None:
    """A ConfigError naming `node` unless `module` can be split `size` ways (every split dimension divides)."""
    from mstar_core.nn.llama import LlamaForCausalLM
    from mstar_core.nn.parallel import check_divisible, llama_dimensions

    dims = getattr(module, "tensor_parallel_dimensions", None)
    if callable(dims):
        check_divisible(f"node '{node}'", dims(expert_parallel=expert_parallel), size)
    elif isinstance(module, LlamaForCausalLM):
        check_divisible(f"node '{node}'", llama_dimensions(module.config), size)
    else:
        raise ConfigError(f"node '{node}': module {type(module).__name__} cannot be split across ranks "
                          f"(tensor_parallel {size}); place it on a worker without tensor_parallel")
