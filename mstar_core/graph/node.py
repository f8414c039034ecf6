"""GraphNode: one component of a composite model, bound to one engine kind."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import attrs

from mstar_core.errors import GraphValidationError

#: Engine kinds every install has; plugins add more (`mstar plugins` lists them).
USUAL_ENGINES = ("kvcache", "stateless", "function")


def _frozen_mapping(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(value or {}))


def _engine_kind(node: GraphNode, _attribute: Any, value: Any) -> None:
    # No default on purpose: a node that silently ran on `function` failed later with a shape error.
    if not isinstance(value, str) or not value:
        given = "no engine=" if value is None else f"engine={value!r}"
        raise GraphValidationError(
            f"GraphNode has {given}; name the engine kind that runs it: "
            f"{', '.join(repr(k) for k in USUAL_ENGINES)}, or a plugin's kind (`mstar plugins` lists them)",
            node=node.name,
        )


def _str_tuple(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@attrs.frozen
class GraphNode:
    """A named component: declared inputs and outputs, the engine kind that runs it, a module factory.

    `engine` is required (no default): 'kvcache', 'stateless', 'function' (a plain callable), or a
    plugin's kind. The engine checks the built module against its contract when the model loads.

    `module` builds the node's `torch.nn.Module` (or any callable the engine accepts); it is called
    once per worker that hosts the node. `options` are engine-specific and static; per-call options
    come from the walk (`NodeCall.options`).
    """

    name: str
    inputs: tuple[str, ...] = attrs.field(converter=_str_tuple)
    outputs: tuple[str, ...] = attrs.field(converter=_str_tuple)
    engine: str = attrs.field(default=None, validator=_engine_kind)
    module: Callable[[], Any] | None = attrs.field(default=None, eq=False)
    optional_inputs: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping, eq=False)
    #: Filled by `Graph.build`: the model's name and `(walk, call options)` for every call of this node in
    #: every walk, so an engine can check call options at load (it is given the node, not the graph).
    graph: str | None = attrs.field(default=None, eq=False, repr=False)
    call_sites: tuple[tuple[str, Mapping[str, Any]], ...] = attrs.field(default=(), eq=False, repr=False)

    @property
    def all_inputs(self) -> tuple[str, ...]:
        return self.inputs + self.optional_inputs


@attrs.frozen
class GraphEdge:
    """Data flowing from one node's output to another node's input (derived from the walks)."""

    src: str
    src_output: str
    dst: str
    dst_input: str
    walk: str


@functools.lru_cache(maxsize=4096)
def parse_port(port: str, what: str) -> tuple[str, str]:
    """Split 'node.port' into its two names (cached: streaming edges ask once per produced item)."""
    node, sep, name = port.partition(".")
    if not sep or not node or not name:
        raise ValueError(f"{what} must look like 'node.port', got {port!r}")
    return node, name
