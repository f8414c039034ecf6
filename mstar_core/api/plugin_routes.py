"""Routes model packages add through `mstar_register_routes`, served beside the core's (none may shadow another)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute, APIWebSocketRoute

from mstar_core.errors import ConfigError


def _claims(route: Any) -> set[tuple[str, str]]:
    """(method or 'WEBSOCKET', path) pairs a route answers; other kinds (mounts) claim their path for all."""
    if isinstance(route, APIWebSocketRoute):
        return {("WEBSOCKET", route.path)}
    if isinstance(route, APIRoute):
        return {(method, route.path) for method in route.methods}
    path = getattr(route, "path", None)
    return {("*", path)} if path is not None else set()


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
