"""Typed control messages: frozen attrs classes, each registered under an explicit wire tag.

A field's annotation decides how it is checked on the way in and out; only the annotations in
`_CHECKS` (plus `X | None` of them) are allowed, so every message stays plain data.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Any

import attrs

from mstar_core.wire.errors import WireError

#: tag -> message class, filled by `@message`.
MESSAGES: dict[str, type] = {}
#: message class -> its tag.
TAGS: dict[type, str] = {}


def _is_int(x: Any) -> bool:
    return type(x) is int


def _is_float(x: Any) -> bool:
    return type(x) in (int, float)


def _is_str_list(x: Any) -> bool:
    return isinstance(x, list) and all(type(s) is str for s in x)


# annotation -> (checker, what to say when it fails). `Value` fields (Any, dict[str, Any]) may hold
# tensors and are encoded by `mstar_core.wire.values`.
_CHECKS: dict[Any, tuple[Callable[[Any], bool], str]] = {
    str: (lambda x: type(x) is str, "a str"),
    int: (_is_int, "an int"),
    float: (_is_float, "a number"),
    bool: (lambda x: type(x) is bool, "a bool"),
    list[str]: (_is_str_list, "a list of str"),
    dict[str, Any]: (lambda x: isinstance(x, dict), "a dict"),
    Any: (lambda x: True, "a value"),
}
VALUE_TYPES = (dict[str, Any], Any)


@attrs.frozen
class FieldSpec:
    """How one message field travels: its name, checker, and whether it may hold tensors."""

    name: str
    check: Callable[[Any], bool]
    what: str
    optional: bool
    value: bool
    required: bool


def _spec(f: attrs.Attribute, hint: Any, cls: type) -> FieldSpec:
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1 or len(typing.get_args(hint)) != 2:
            raise TypeError(f"{cls.__name__}.{f.name}: only `X | None` unions are allowed")
        hint, optional = args[0], True
    if hint not in _CHECKS:
        raise TypeError(f"{cls.__name__}.{f.name}: annotation {hint!r} cannot travel on the wire")
    check, what = _CHECKS[hint]
    return FieldSpec(f.name, check, what, optional, hint in VALUE_TYPES, f.default is attrs.NOTHING)


def message(tag: str) -> Callable[[type], type]:
    """Class decorator: make a frozen, keyword-only attrs message and register it under `tag`."""

    def wrap(cls: type) -> type:
        if tag in MESSAGES:
            raise ValueError(f"wire tag '{tag}' already used by {MESSAGES[tag].__name__}")
        cls = attrs.frozen(kw_only=True)(cls)
        hints = typing.get_type_hints(cls)
        cls.__wire_fields__ = tuple(_spec(f, hints[f.name], cls) for f in attrs.fields(cls))
        MESSAGES[tag] = cls
        TAGS[cls] = tag
        return cls

    return wrap


def check_field(spec: FieldSpec, value: Any, tag: str) -> None:
    """Raise WireError unless `value` fits the field."""
    if value is None and spec.optional:
        return
    if not spec.check(value):
        none = " or None" if spec.optional else ""
        raise WireError(f"message '{tag}' field '{spec.name}' must be {spec.what}{none}, got {type(value).__name__}")


@message("hello")
class Hello:
    """A worker asks to join; `mac` is HMAC-SHA256 over the other fields with the shared secret."""

    worker: str
    pid: int
    host: str
    protocol: int
    nonce: str
    timestamp: float
    mac: str


@message("welcome")
class Welcome:
    """The coordinator accepts a worker; `mac` proves it knows the secret too (binds the hello nonce)."""

    worker: str
    session: str
    heartbeat_interval: float
    nonce: str
    mac: str
    #: the registered transport that carries this worker's tensors (the placement's `transport`)
    transport: str = "zmq"


@message("heartbeat")
class Heartbeat:
    """Liveness ping with a monotonically increasing sequence number and optional load figures."""

    worker: str
    seq: int
    time: float
    load: dict[str, Any] = attrs.field(factory=dict)


@message("load_model")
class LoadModel:
    """Ask a worker to load a model and build engines for the listed nodes."""

    model: str
    device: str
    nodes: list[str]
    preset: str | None = None
    checkpoint: str | None = None
    dtype: str | None = None
    settings: dict[str, Any] = attrs.field(factory=dict)
    #: checkpoints of the model's separately published parts (`LoadOptions.parts`): part name -> path or Hub id
    parts: dict[str, Any] = attrs.field(factory=dict)
    #: this worker's place in a tensor-parallel group: {rank, size, store (host:port), prefix, backend}; empty: none
    tensor_parallel: dict[str, Any] = attrs.field(factory=dict)


@message("model_loaded")
class ModelLoaded:
    """A worker finished loading a model; `nodes` are the engines it now serves."""

    worker: str
    model: str
    nodes: list[str]


@message("invoke_node")
class InvokeNode:
    """Run one node call for one request; `inputs` values may be tensors or nested plain values.

    `arrival` is the request's arrival on the serving process's monotonic clock (`Invocation.arrival`):
    the worker's schedulers take the oldest request first, as they would in the serving process.
    """

    request_id: str
    node: str
    call_index: int
    inputs: dict[str, Any]
    options: dict[str, Any] = attrs.field(factory=dict)
    arrival: float = 0.0
    #: the call's `Invocation.priority` (its stream's, plus its request's class: background for a batch line)
    priority: float = 0.0


@message("node_result")
class NodeResult:
    """The outcome of an InvokeNode: exactly one of `outputs` or `error` (with `error_type`).

    `error_status` is the HTTP-style status of a request error raised in the worker (a 4xx for the
    client's own mistakes), so it keeps its class at the edge, and `error_param` the request field it
    names (`RequestError.param`), so the client's 4xx still says which field to fix; None otherwise.
    """

    request_id: str
    node: str
    call_index: int
    outputs: dict[str, Any] | None = None
    error: str | None = None
    error_type: str | None = None
    error_status: int | None = None
    error_param: str | None = None

    def __attrs_post_init__(self) -> None:
        if (self.outputs is None) == (self.error is None):
            raise WireError("NodeResult needs exactly one of `outputs` or `error`")
        if self.error is not None and self.error_type is None:
            raise WireError("NodeResult with an `error` needs its `error_type`")


@message("release")
class Release:
    """Free everything a worker holds for a request."""

    request_id: str


@message("shutdown")
class Shutdown:
    """Ask a worker to finish and exit; `rejoin`: it was declared lost (e.g. cut off by a partition), join again."""

    reason: str = ""
    rejoin: bool = False


@message("error_report")
class ErrorReport:
    """A worker reports a failure (for one request if `request_id` is set, else worker-wide)."""

    worker: str
    message: str
    error_type: str
    request_id: str | None = None


@message("run_loop")
class RunLoop:
    """Run one loop of a walk on the worker that hosts all of its nodes ("loops run where their nodes live").

    `loop` indexes the walk's loops in depth-first order; `env` is the request's env on entry;
    `branch` tells apart the copies of one loop that fan-out branches run at once ("" outside one);
    `arrival` is the request's (see `InvokeNode`), for the calls the loop makes there.
    `streams` maps a stream's index (as a str) to where the loop sends that stream's items itself,
    worker to worker (`to`: the consumer's peer mailbox, `nonce`, `session`, `start`: items already
    sent on it); those items are then not forwarded to the caller unless the walk emits them.
    """

    request_id: str
    model: str
    walk: str
    loop: int
    env: dict[str, Any]
    branch: str = ""
    streams: dict[str, Any] = attrs.field(factory=dict)
    arrival: float = 0.0
    #: the request's priority class (`RequestState.priority`), for the calls the loop makes there
    priority: float = 0.0


@message("loop_values")
class LoopValues:
    """Outputs of one node call inside a delegated loop that the caller must see (emitted or streamed)."""

    request_id: str
    loop: int
    call: int
    outputs: dict[str, Any]
    branch: str = ""


@message("loop_done")
class LoopDone:
    """A delegated loop finished: the env names it changed, or the error that stopped it (see NodeResult)."""

    request_id: str
    loop: int
    env: dict[str, Any] | None = None
    error: str | None = None
    error_type: str | None = None
    node: str | None = None
    error_status: int | None = None
    error_param: str | None = None
    branch: str = ""
    #: stream index (as a str) -> items this run sent straight to the stream's consumer worker
    streamed: dict[str, Any] = attrs.field(factory=dict)


@message("run_consumer")
class RunConsumer:
    """Run stream `stream`'s consumer on this worker, fed by items its producer worker sends here directly.

    The items come sealed under (`nonce`, `session`) to this worker's peer mailbox; the stream's
    chunk policy runs here. Answers are `LoopValues`/`LoopDone` with `loop` = -1 - `stream`.
    `streams` routes the streams this consumer produces in turn straight to their own consumer's
    worker, as `RunLoop.streams` does (the items sent are counted in `LoopDone.streamed`).
    """

    request_id: str
    model: str
    walk: str
    stream: int
    env: dict[str, Any]
    nonce: str
    session: str
    branch: str = ""
    arrival: float = 0.0  # the request's (see `InvokeNode`), for the consumer's calls there
    streams: dict[str, Any] = attrs.field(factory=dict)
    priority: float = 0.0  # the request's class (see `RunLoop`), for the consumer's calls there

    @property
    def loop(self) -> int:
        """The key its answers travel under (negative: never a loop's index)."""
        return -1 - self.stream


@message("stream_item")
class StreamItem:
    """One item of a stream, from the producer worker straight to the consumer worker (never via the server)."""

    request_id: str
    stream: int
    value: Any


@message("stream_end")
class StreamEnd:
    """The stage producing stream `stream` ended after `items` items: the consumer closes it once all arrived."""

    request_id: str
    stream: int
    items: int
    branch: str = ""
