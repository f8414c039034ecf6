"""The placement strategy for nodes placed on workers: the `PlacementStrategy` that `AsyncEngine` is handed."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable
from typing import Any

import attrs
import torch

from mstar_core.cluster.cluster import Cluster
from mstar_core.cluster.links import check_transports
from mstar_core.cluster.rank_groups import check_rank_group
from mstar_core.cluster.remote_loop import delegate_loops
from mstar_core.cluster.remote_node import RemoteNodeScheduler
from mstar_core.cluster.remote_stream import plan_direct_streams
from mstar_core.cluster.worker_link import WorkerLost
from mstar_core.config.placement import LOCAL, Placement
from mstar_core.errors import ConfigError
from mstar_core.model import LoadedModel, LoadOptions
from mstar_core.runtime.async_engine import AsyncEngine
from mstar_core.runtime.placing import PlacedModel, PlacementHost, Settings, node_workers
from mstar_core.wire import LoadModel
from mstar_core.wire.auth import secret_from_env

log = logging.getLogger("mstar.cluster")


class WorkerPlacement:
    """Runs placed nodes in worker processes (spawned here, Ray actors, or joining from other hosts).

    One `Cluster` (the control socket and every worker) serves all the models an engine places;
    it starts with the first of them.
    """

    def __init__(self) -> None:
        self.cluster: Cluster | None = None

    async def place(self, host: PlacementHost, family: str, loaded: LoadedModel, options: LoadOptions,
                    placement: Placement, settings: Settings) -> PlacedModel:
        graph = loaded.graph
        check_transports(placement, host.registry)
        for node in placement.walks:
            engine_cls = host.registry.engines.get(graph.nodes[node].engine)
            if not getattr(engine_cls, "moves_state", False):
                raise ConfigError(f"{placement.source}: node '{node}' runs on the '{graph.nodes[node].engine}' engine, "
                                  "which cannot move a request's state between workers; place it on one worker")
        where = node_workers(graph, placement)
        by_worker: dict[str, list[str]] = {}
        for node, workers in where.items():
            for worker in sorted(workers - {LOCAL}):
                by_worker.setdefault(worker, []).append(node)
        for group, nodes in by_worker.items():  # a split that cannot work fails here, before anything starts
            if placement.workers[group].group_size > 1:
                check_rank_group(placement.source, placement.workers[group], graph, nodes, host.registry.engines)
        settings = {**placement.engine_settings, **settings}
        cluster = await self._cluster(host, placement)
        engines = await host.build_local(loaded, settings, {n for n, workers in where.items() if LOCAL in workers})
        on_worker: dict[tuple[str, str], Any] = {(n, LOCAL): host.local_scheduler(e) for n, e in engines.items()}
        share = thread_share(placement, host.torch_threads)

        async def start_and_load(replica: str, spec: Any, msg: LoadModel) -> None:
            await cluster.ensure_worker(replica, spec)
            await cluster.load(replica, msg)

        async def start_and_load_group(ranks: tuple[str, ...], spec: Any, msg: LoadModel) -> None:
            devices = spec.rank_devices()
            await asyncio.gather(*(cluster.ensure_worker(r, attrs.evolve(spec, device=d)) for r, d in zip(ranks, devices, strict=True)))
            # every rank loads at once: they meet at the rendezvous, then each reads only its slices
            await asyncio.gather(*(cluster.load(r, cluster.rank_groups.load_message(msg, ranks, i, d))
                                   for i, (r, d) in enumerate(zip(ranks, devices, strict=True))))

        starts = []  # every worker starts and loads at once: one's imports and load overlap the others'
        for group, nodes in by_worker.items():
            spec = placement.workers[group]
            if spec.launcher == "spawn" and spec.threads is None:
                spec = attrs.evolve(spec, threads=share)
            replicas = spec.replica_names()
            msg = LoadModel(model=family, device=spec.device, nodes=nodes, preset=options.preset,
                            checkpoint=options.checkpoint, parts=dict(options.parts), dtype=options.dtype,
                            settings={n: dict(settings.get(n, {})) for n in nodes})
            if spec.group_size > 1:
                starts += [start_and_load_group(cluster.rank_groups.register(spec.rank_names(r), spec.expert_parallel > 1), spec, msg)
                           for r in replicas]
            else:
                starts += [start_and_load(r, spec, msg) for r in replicas]
            for node in nodes:
                on_worker[node, group] = RemoteNodeScheduler(cluster, family, node, replicas)
        await asyncio.gather(*starts)
        # a node's default scheduler (its only one, unless placed per walk: then the local one if any)
        schedulers = {n: on_worker[n, min(workers, key=lambda w: (w != LOCAL, w))] for n, workers in where.items()}
        walk_schedulers = {}
        for node in placement.walks:
            for walk in graph.walks:
                key = (node, placement.worker_of(node, walk))
                if key in on_worker:  # walks that never call the node have no engine for it
                    walk_schedulers[walk, node] = on_worker[key]

        def attach(conductor: Any) -> None:
            delegate_loops(conductor, cluster, family)
            plan_direct_streams(conductor, cluster, family)  # items between workers go peer to peer

        return PlacedModel(engines, schedulers, walk_schedulers, attach if placement.delegate_loops else None)

    async def _cluster(self, host: PlacementHost, placement: Placement) -> Cluster:
        if self.cluster is None:
            joins_by_hand = any(not w.spawned for w in placement.workers.values())
            cluster = Cluster(
                bind=placement.bind,
                heartbeat_interval=placement.heartbeat_interval,
                secret=secret_from_env() if joins_by_hand or placement.bind or placement.encrypt else None,
                registry=host.registry,
                encrypt=placement.encrypt,
            )

            def lost(worker: str, request_ids: Iterable[str], why: str) -> None:
                host.fail_requests(request_ids, lambda: WorkerLost(f"worker '{worker}' {why}; the request was lost, retry it"))

            cluster.on_requests_lost = lost
            await cluster.start()
            self.cluster = cluster
        return self.cluster

    async def close(self) -> None:
        if self.cluster is not None:
            await self.cluster.close()
            self.cluster = None


def thread_share(placement: Placement, torch_threads: int | str | None) -> int:
    """Split this host's cores between the serving process and the workers it spawns here.

    Processes whose torch thread pools together exceed the cores slow each other down many
    times over (spinning OpenMP threads), so each gets an even share, this process included.
    """
    spawned = sum(w.replicas * w.group_size for w in placement.workers.values() if w.launcher == "spawn")
    share = max(1, (os.cpu_count() or 1) // (spawned + 1))
    # this process's own pool is the caller's to set (an embedding application has its own plans)
    if torch_threads == "share" and spawned and torch.get_num_threads() > share:
        log.info("placement spawns %d worker processes here: torch threads per process set to %d", spawned, share)
        torch.set_num_threads(share)
    return share


def placed_engine(registry: Any = None, **options: Any) -> AsyncEngine:
    """An `AsyncEngine` that can place nodes on workers (`AsyncEngine` options as keywords)."""
    return AsyncEngine(registry, placement_strategy=WorkerPlacement(), **options)
