"""Routes model packages add through `mstar_register_routes`, served beside the core's (none may shadow another)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIWebSocketRoute
from starlette.routing import WebSocketRoute

from mstar_core.errors import ConfigError


def _claims(route: Any) -> set[tuple[str, str]]:
    """(method or 'WEBSOCKET', path) pairs a route answers; a route without methods (a mount) claims its path for all.

    An included router (FastAPI keeps it as one entry of `app.routes`) claims what its own routes do, under its prefix.
    """
    inner = getattr(route, "original_router", None)
    if inner is not None:
        prefix = getattr(getattr(route, "include_context", None), "prefix", "") or ""
        return {(method, prefix + path) for r in inner.routes for method, path in _claims(r)}
    path = getattr(route, "path", None)
    if path is None:
        return set()
    if isinstance(route, APIWebSocketRoute | WebSocketRoute):
        return {("WEBSOCKET", path)}
    methods = getattr(route, "methods", None)
    return {(method, path) for method in methods} if methods else {("*", path)}


def include_plugin_routes(app: FastAPI, factories: Iterable[tuple[str, Any]]) -> None:
    """Include each plugin's router (from its factory); a route another already answers is a startup error naming both."""
    owner: dict[tuple[str, str], str] = {claim: "the core" for route in app.routes for claim in _claims(route)}
    for plugin, make_router in factories:
        router = make_router()
        if not isinstance(router, APIRouter):
            raise ConfigError(f"plugin {plugin}'s mstar_register_routes factory returned {type(router).__name__}, "
                              "not a fastapi.APIRouter")
        for route in router.routes:
            for claim in _claims(route):
                method, path = claim
                taken = owner.get(claim) or owner.get(("*", path))
                if taken is not None:
                    raise ConfigError(f"plugin {plugin} adds route {method} {path}, which {taken} already serves; "
                                      "give it another path (or restrict plugins with MSTAR_PLUGINS)")
                owner[claim] = f"plugin {plugin}"
        app.include_router(router)
