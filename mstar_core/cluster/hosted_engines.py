"""The engines a worker hosts: models loaded for the nodes placed on it, their schedulers, and their gauges.

Engines are built on the worker's one device thread, the same thread their steps later run on.
The ranks of a tensor-parallel group meet once at the group's rendezvous; ranks 1..N-1 get no
scheduler of their own but a `RankFollower` that runs rank 0's steps on their engines.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from mstar_core.checkpoint.hub import resolve_options
from mstar_core.checkpoint.partial import node_module, release_unhosted, resident_parameters
from mstar_core.cluster.loop_host import LoopHostConductor
from mstar_core.cluster.rank_follower import RankFollower, join_rank_group
from mstar_core.errors import ConfigError
from mstar_core.model import LoadOptions
from mstar_core.plugins.manager import default_registry
from mstar_core.runtime.engine import EngineContext, active_limit, build_order, call_order
from mstar_core.runtime.rank_steps import RankGroup
from mstar_core.runtime.scheduler import NodeScheduler
from mstar_core.wire import LoadModel


class HostedEngines:
    """Schedulers keyed 'model/node', loop hosts per model, what the process holds resident, its device thread."""

    def __init__(self, name: str):
        self.name = name
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mstar-device-{name}")
        self.schedulers: dict[str, NodeScheduler] = {}
        self.hosts: dict[str, LoopHostConductor] = {}  # model -> conductor for loops delegated here
        #: what this process holds: {"parameters", "parameter_bytes"} overall and per 'model/node' (fixed once loaded)
        self.resident: dict[str, dict[str, int]] = {}
        self.graphs: dict = {}  # model -> its graph (modules of nodes hosted elsewhere on the meta device)
        self.rank_group: tuple | None = None  # (split, channel) once this worker joined a tensor-parallel group
        self.follower: RankFollower | None = None  # ranks 1..N-1: runs rank 0's steps on this rank's engines

    async def registry(self) -> Any:
        """The plugin registry, imported on the device thread (off the event loop that must keep beating)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, default_registry)

    async def load(self, msg: LoadModel) -> None:
        """Build engines for the nodes `msg` places here (raises whatever loading raised)."""
        for node_name, node_settings in msg.settings.items():  # before anything loads: the calls' leads stay home
            if node_settings.get("admit_streams") not in (None, False):
                raise ConfigError(f"node '{node_name}': setting 'admit_streams' is not supported on a node placed in "
                                  "a worker process yet (its calls' stream leads do not cross the wire)")
        loop = asyncio.get_running_loop()
        registry = await self.registry()
        spec = registry.models.get(msg.model)
        if msg.tensor_parallel and self.rank_group is None:  # every rank of the group meets here once
            self.rank_group = await loop.run_in_executor(self.executor, join_rank_group, msg.tensor_parallel,
                                                         msg.device)
            if self.rank_group[0].rank > 0:
                self.follower = RankFollower(self.name, self.rank_group[1])
        split = self.rank_group[0] if msg.tensor_parallel and self.rank_group else None
        options = LoadOptions(checkpoint=msg.checkpoint, preset=msg.preset, device=msg.device, dtype=msg.dtype,
                              nodes=tuple(msg.nodes), tensor_parallel=split, parts=msg.parts)
        options = await loop.run_in_executor(self.executor, resolve_options, options)  # a Hub id: this host's cache
        loaded = await loop.run_in_executor(self.executor, spec.load, options)
        await loop.run_in_executor(self.executor, release_unhosted, loaded.graph, msg.nodes)
        self.graphs[msg.model] = loaded.graph
        device = torch.device(msg.device)
        built = {}
        for node_name in build_order(loaded.graph, msg.nodes):
            node = loaded.graph.nodes[node_name]
            settings = {**loaded.engine_settings.get(node_name, {}), **msg.settings.get(node_name, {})}
            settings.pop("own_thread", None)  # a worker's nodes share its one device thread
            limit = active_limit(node_name, settings.pop("max_active_requests", None))
            order = call_order(node_name, settings.pop("call_order", None))
            settings.pop("admit_streams", None)  # (a user's setting is refused above; a model's default is dropped)
            engine_cls = registry.engines.get(node.engine)
            key = f"{msg.model}/{node_name}"
            ranks = RankGroup(split, self.rank_group[1], key) if split is not None else None
            context = EngineContext(self.name, device, settings, registry, peers=dict(built), rank_group=ranks)
            module = node.module() if node.module is not None else None
            built[node_name] = engine = await loop.run_in_executor(self.executor, engine_cls, node, module, context)
            engine.max_active_requests, engine.call_order = limit, order
            if self.follower is not None:
                self.follower.add(key, engine)  # steps come from rank 0, not from a scheduler here
            else:
                self.schedulers[key] = NodeScheduler(engine, self.executor)
        self._count_resident()
        if self.follower is not None:
            self.follower.start()
        else:
            local = {n: self.schedulers[f"{msg.model}/{n}"] for n in msg.nodes}
            self.hosts[msg.model] = LoopHostConductor(loaded.graph, local)

    def _count_resident(self) -> None:
        resident = {}
        for model, graph in self.graphs.items():
            for name, node in graph.nodes.items():
                key = f"{model}/{name}"
                if key in self.schedulers or (self.follower is not None and key in self.follower.engines):
                    resident[f"{model}/{name}"] = resident_parameters([node_module(node)])
        every = [node_module(node) for graph in self.graphs.values() for node in graph.nodes.values()]
        resident["process"] = resident_parameters(every)
        self.resident = resident

    def gauges(self) -> dict[str, Any]:
        """Each engine's gauges with what it holds resident, and the process's total (for the heartbeat)."""
        load = {}
        engines = {key: sched.engine for key, sched in self.schedulers.items()}
        engines.update(self.follower.engines if self.follower is not None else {})
        for key, engine in engines.items():
            try:
                load[key] = {**engine.stats(), **self.resident.get(key, {})}
            except Exception:  # gauges are optional; the beat is not
                load[key] = dict(self.resident.get(key, {}))
        if "process" in self.resident:
            load["process"] = self.resident["process"]
        return load

    def release(self, request_id: str) -> None:
        for sched in self.schedulers.values():
            sched.release(request_id)

    async def close_schedulers(self) -> None:
        for sched in self.schedulers.values():
            await sched.close()

    def stop_device_thread(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
