"""The engine contract: what an engine is given, what it returns, how it frees a request.

The runtime's micro-scheduler owns one engine per (worker, node). It hands the engine
`Invocation`s as requests reach the node, then calls `step()` on the worker's device thread
while `has_work()` is true. `step()` returns the invocations it finished, each with its outputs
or the exception that failed it; unfinished ones stay inside the engine (a paged-KV engine may
spread one long prefill over several steps). `release(request_id)` drops everything the engine
holds for a request; the scheduler only calls it between steps, never during one.

Failures stay with their request: one invocation's bad input must fail that invocation alone. An
engine that batches retries the rest of a batch that raised (one by one if need be) rather than
failing every request in it; `step()` raising fails everything the engine holds.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from mstar_core.errors import ConfigError
from mstar_core.graph.options import node_ref_options, record_engine_options

if TYPE_CHECKING:
    import torch

    from mstar_core.graph.node import GraphNode
    from mstar_core.plugins.manager import Registry
    from mstar_core.runtime.stream_admission import StreamAdmission


@attrs.define(eq=False, slots=True)
class Invocation:
    """One request's call of one node.

    `inputs` maps the node's input names to values (tensors, ints, lists, `Chunk`s, request
    parameters). `options` are the node's static options overlaid with the walk's per-call ones
    (e.g. `cache_label`, `write_cache`). `call_index` counts this request's calls of this node,
    so an engine can tell a first call (prefill) from later ones if it needs to.
    """

    request_id: str
    node: str
    inputs: dict[str, Any]
    options: Mapping[str, Any]
    call_index: int = 0
    priority: float = 0.0
    #: the request's arrival (`time.monotonic()` in the serving process); on a node with `call_order="fifo"`
    #: the node's scheduler restamps each call with its submission instead (see `call_order`)
    arrival: float = 0.0
    #: seconds of media the request's listener has ahead when the call was made (of its ranked streams, the one
    #: furthest behind: `StreamPriority.lead`); None: no stream of it plays yet, or none is ranked. What the node
    #: setting `admit_streams` reads (see `runtime.stream_admission`).
    lead: float | None = None

    @property
    def urgency(self) -> tuple[float, float]:
        """Sort key where a step cannot take every waiting call: the most urgent priority (a stream running dry)
        first, then the oldest request."""
        return (-self.priority, self.arrival)


#: A request's priority class for work that may wait (the Batch API's lines): added to each of its calls' priority,
#: it ranks them below every live call (stream priorities stay within +-their horizon, seconds), so schedulers that
#: order by `urgency` run and admit live requests first and preempt background ones first.
BACKGROUND_PRIORITY = -1.0e6


def is_background(priority: float) -> bool:
    """Whether a call's priority puts it in the background class (`BACKGROUND_PRIORITY`)."""
    return priority <= BACKGROUND_PRIORITY / 2


Result = tuple[Invocation, "dict[str, Any] | BaseException"]


@attrs.frozen
class EngineContext:
    """What a worker tells an engine about where it runs.

    `peers` are the engines of the same model this process built before this one, by node name
    (`build_order`: a node another node's option names, e.g. `share_cache_with`, is built first).
    That is how engines share state the runtime owns nothing of: a KV-cache reader adopts its
    partner's page pool, which lives with the partner.
    """

    worker: str
    device: torch.device
    settings: Mapping[str, Any]
    registry: Registry | None = None
    peers: Mapping[str, Engine] = attrs.field(factory=dict, eq=False)
    #: the node's rank group when it is split across processes (`runtime.rank_steps.RankGroup`); None: one process
    rank_group: Any = attrs.field(default=None, eq=False)


def active_limit(node: str, value: Any) -> int | None:
    """The node setting `max_active_requests` checked: a positive int, or None for no limit."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"node '{node}': setting 'max_active_requests' must be a positive integer, got {value!r}")
    return value


#: The node setting `call_order`: "urgency" (default) takes the calls a step cannot all take most urgent stream
#: first, then oldest request; "fifo" serves them in submission order, ignoring stream priority and request age.
CALL_ORDERS = ("urgency", "fifo")


def call_order(node: str, value: Any) -> str:
    """The node setting `call_order` checked: one of `CALL_ORDERS` (None: "urgency")."""
    if value is None:
        return "urgency"
    if not isinstance(value, str) or value not in CALL_ORDERS:
        raise ConfigError(f"node '{node}': setting 'call_order' must be one of {', '.join(map(repr, CALL_ORDERS))}, "
                          f"got {value!r}")
    return value


def build_order(graph: Any, names: Iterable[str]) -> list[str]:
    """`names` in graph order, except that a node named by another's node-ref option comes before it."""
    todo = [n for n in graph.nodes if n in set(names)]
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in order or name not in todo:
            return
        if name in path:  # a cycle of references: graph order decides (the engines report what they miss)
            return
        node = graph.nodes[name]
        for option in sorted(node_ref_options(node.engine)):
            ref = node.options.get(option)
            if isinstance(ref, str):
                visit(ref, (*path, name))
        if name not in order:
            order.append(name)

    for name in todo:
        visit(name, ())
    return order


class Engine(abc.ABC):
    """Base class of every engine plugin (built-in ones included)."""

    kind: ClassVar[str]
    #: Run `step()` on the event loop thread instead of the device thread (cheap python nodes).
    inline: ClassVar[bool] = False
    #: Set by the runtime from the node setting `own_thread`: steps run on a device thread of their own.
    own_thread: bool = False
    #: Set by the runtime from the node setting `max_active_requests`: at most that many requests' calls
    #: reach the engine at once, admitted oldest first (None: no limit). See `runtime.scheduler`.
    max_active_requests: int | None = None
    #: Set by the runtime from the node setting `admit_streams`: admit a new request only while the admitted ones'
    #: streams stay ahead of real time (None: off). See `runtime.stream_admission`.
    admit_streams: StreamAdmission | None = None
    #: Set by the runtime from the node setting `call_order`: with "fifo" the node's scheduler hands every call
    #: over at priority 0 stamped with its submission as `arrival`, so an engine that orders by `urgency` serves
    #: calls in submission order without knowing the setting. See `runtime.scheduler`.
    call_order: str = "urgency"
    #: Whether the engine answers the transfer invocations that move a request's state to another
    #: worker (per-walk placement): option `transfer="export"` returns `{"state": ...}` and frees
    #: the request here; `transfer="import"` with input `state` adopts it.
    moves_state: ClassVar[bool] = False
    #: The `typing.Protocol` a node's module must meet (see `mstar_core.runtime.contract`); None when
    #: the engine takes any module. An engine checks it in `__init__`, so a module that cannot take
    #: the engine's calls fails the model's load, not its first request.
    module_contract: ClassVar[type | None] = None
    #: The options a walk's `NodeCall(options=...)` may pass; None: the kind's options are not checked.
    #: `Graph.build` rejects any other (node options included), naming the walk, node and known options.
    call_options: ClassVar[frozenset[str] | None] = None
    #: Options only the node may set (`GraphNode(options=...)`), besides the call options.
    node_options: ClassVar[frozenset[str]] = frozenset()
    #: Options whose value names another node of the same kind (`share_cache_with`): built before this one.
    node_ref_options: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # a class that sets any of the three (an inherited kind included) records them for Graph.build
        declares = {"call_options", "node_options", "node_ref_options"} & set(vars(cls))
        if declares and cls.call_options is not None and isinstance(getattr(cls, "kind", None), str):
            record_engine_options(cls.kind, cls.call_options | cls.node_options, cls.node_ref_options)

    def __init__(self, node: GraphNode, module: Any, context: EngineContext):
        self.node = node
        self.module = module
        self.context = context

    @property
    def max_batch_size(self) -> int:
        """How many invocations one `step()` may take; the scheduler never adds more than it can hold."""
        return int(self.context.settings.get("max_batch_size", 64))

    @abc.abstractmethod
    def add(self, invocation: Invocation) -> None:
        """Accept an invocation; it is answered by a later `step()`.

        Whatever this invocation's inputs trigger should be its answer from the next step, not an
        exception: the scheduler does fail just this invocation if `add` raises, but an engine
        left half-changed by it may then disturb the other requests it holds.
        """

    @abc.abstractmethod
    def step(self) -> list[Result]:
        """Run one batch; return the invocations finished by it (outputs or exception each)."""

    @abc.abstractmethod
    def has_work(self) -> bool:
        """Whether `step()` has anything to do."""

    def answers_only(self) -> bool:
        """Whether the next `step()` only hands back answers found without device work (no forward pass); the
        scheduler then calls it on the event loop, without a hop to the device thread. False by default."""
        return False

    @abc.abstractmethod
    def release(self, request_id: str) -> None:
        """Forget a request: drop its queued invocations and free its caches and buffers."""

    @abc.abstractmethod
    def active_requests(self) -> set[str]:
        """Requests the engine holds any state for (queued work, KV pages, buffers)."""

    def stats(self) -> dict[str, float]:
        """Gauges for metrics (e.g. `kv_pages_used`); empty by default."""
        return {}

    def close(self) -> None:
        """Free the engine's memory when the model is unloaded."""
        return None
