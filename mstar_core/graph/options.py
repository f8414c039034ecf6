"""Per-call option names each engine kind understands, and the check that a walk uses only those.

An engine class declares its options (`call_options`, `node_options`, `node_ref_options` on the
`Engine` subclass; recorded here when the class is defined, see `Engine.__init_subclass__`);
`Graph.build` then rejects a misspelt option (`cache_lable`) naming the
walk, the node and the known options. Graph building cannot reach the plugin registry, so an engine
whose plugin was not imported yet is checked again when the engine is built: `GraphNode.call_sites`
(recorded by `Graph.build`) lists every call of the node in every walk, and the engine runs
`check_call_options` over them at model load. Either way the error comes before any request.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

from mstar_core.compat import changed
from mstar_core.errors import GraphValidationError

_KNOWN: dict[str, frozenset[str]] = {}
_NODE_REFS: dict[str, frozenset[str]] = {}


def record_engine_options(kind: str, names: Iterable[str], node_refs: Iterable[str] = ()) -> None:
    """Record the options engine `kind` understands (node-static ones included); its class does this when defined.

    `node_refs` are options whose value names another node of the graph (`share_cache_with`):
    `Graph.build` checks that node exists and runs on the same engine kind.
    """
    _KNOWN[kind] = frozenset(names)
    _NODE_REFS[kind] = frozenset(node_refs)


def declare_call_options(kind: str, names: Iterable[str], node_refs: Iterable[str] = ()) -> None:
    """The plugin API 1.0 way to declare an engine's options: warns in 1.1 (declare them on the class), errors after."""
    changed("declare_call_options")
    record_engine_options(kind, names, node_refs)


def node_ref_options(kind: str) -> frozenset[str]:
    """The options of `kind` that name another node."""
    return _NODE_REFS.get(kind, frozenset())


def known_call_options(kind: str) -> frozenset[str] | None:
    """The options declared for `kind`, or None when no engine of that kind declared any (yet)."""
    return _KNOWN.get(kind)


def check_call_options(
    node: str,
    kind: str,
    sites: Iterable[tuple[str, Mapping[str, Any]]],
    known: Collection[str],
    static: Mapping[str, Any] | None = None,
) -> None:
    """Raise `GraphValidationError` for the first option of `node` (static or at a call site) not in `known`."""
    allowed = set(known)
    bad = sorted(set(static or {}) - allowed)
    if bad:
        raise GraphValidationError(
            f"unknown option(s) {bad} on the node (engine '{kind}'); known options: {sorted(allowed)}", node=node
        )
    for walk, options in sites:
        bad = sorted(set(options) - allowed)
        if bad:
            raise GraphValidationError(
                f"unknown call option(s) {bad} (engine '{kind}'); known options: {sorted(allowed)}; "
                "fix the spelling in the walk's NodeCall(options=...)",
                walk=walk, node=node,
            )
