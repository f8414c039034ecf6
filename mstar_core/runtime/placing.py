"""The seam between the in-process runtime and a runtime that runs placed nodes in other processes.

`AsyncEngine` knows no worker process: a placement that puts nodes elsewhere is handed to the
`PlacementStrategy` its builder gave it (`mstar_core.cluster.strategy.WorkerPlacement`: worker
processes behind a control socket). The strategy borrows the engine's own engines and schedulers
for the nodes that stay here (`PlacementHost`) and answers with a scheduler for every node.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from mstar_core.config.placement import Placement
from mstar_core.graph.graph import Graph
from mstar_core.graph.walk import iter_walk_calls

if TYPE_CHECKING:
    from mstar_core.model import LoadedModel, LoadOptions
    from mstar_core.plugins.manager import Registry
    from mstar_core.runtime.conductor import Conductor
    from mstar_core.runtime.engine import Engine
    from mstar_core.runtime.scheduler import NodeScheduler

Settings = Mapping[str, Mapping[str, Any]]


@attrs.frozen
class PlacedModel:
    """A model's nodes as a strategy placed them: what the conductor calls, and what this process built."""

    engines: dict[str, Engine]  # the engines built in this process
    schedulers: dict[str, Any]  # node -> its scheduler (here, or a stand-in for one in another process)
    walk_schedulers: dict[tuple[str, str], Any]  # (walk, node) -> scheduler, for nodes placed per walk
    #: called with the model's conductor before its first request (e.g. hand it loops the workers run themselves)
    attach: Callable[[Conductor], None] | None = None


class PlacementHost(Protocol):
    """What `AsyncEngine` lends a strategy: its registry, and engines and schedulers for the nodes kept here."""

    registry: Registry
    torch_threads: int | str | None

    async def build_local(self, loaded: LoadedModel, settings: Settings, nodes: set[str]) -> dict[str, Engine]:
        """Build this process's engines for `nodes` (off the event loop)."""
        ...

    def local_scheduler(self, engine: Engine) -> NodeScheduler:
        """The scheduler of an engine built here."""
        ...

    def fail_requests(self, request_ids: Iterable[str], error: Callable[[], Exception]) -> None:
        """Fail these requests now (their state was lost elsewhere), each with an `error()` of its own."""
        ...


class PlacementStrategy(Protocol):
    """Runs the nodes a placement puts outside this process."""

    async def place(self, host: PlacementHost, family: str, loaded: LoadedModel, options: LoadOptions,
                    placement: Placement, settings: Settings) -> PlacedModel:
        """Start what `placement` needs for `loaded` and return a scheduler for each of its nodes."""
        ...

    async def close(self) -> None:
        """Stop everything `place` started (idempotent)."""
        ...


def node_workers(graph: Graph, placement: Placement) -> dict[str, set[str]]:
    """Where each node runs: one worker, or (placed per walk) the workers of the walks that call it."""
    where: dict[str, set[str]] = {}
    for node in graph.nodes:
        callers = [w.name for w in graph.walks.values()
                   if any(c.node == node for c in iter_walk_calls(w)) or any(e.dst_node == node for e in w.streams)]
        if node in placement.walks and callers:
            where[node] = {placement.worker_of(node, walk) for walk in callers}
        else:
            where[node] = {placement.worker_of(node)}
    return where
