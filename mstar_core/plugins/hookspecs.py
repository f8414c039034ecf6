"""Every hook M* calls, in one module. Plugins implement them with `mstar_core.hookimpl`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("mstar")
hookimpl = pluggy.HookimplMarker("mstar")


@hookspec
def mstar_register_models(register: Callable[[Any], None]) -> None:
    """Register model families: call `register(spec)` with a `mstar_core.model.ModelSpec`."""


@hookspec
def mstar_register_engines(register: Callable[[str, type], None]) -> None:
    """Register engine kinds: call `register(kind, EngineClass)`."""


@hookspec
def mstar_register_transports(register: Callable[[str, Any], None]) -> None:
    """Register transports: call `register(name, TransportClass)`."""


@hookspec
def mstar_register_attention_backends(register: Callable[[str, Any], None]) -> None:
    """Register attention backends: call `register(name, BackendClass)`."""


@hookspec
def mstar_register_api_adapters(register: Callable[[Any], None]) -> None:
    """Register API adapters that map OpenAI-style routes onto a model's walks: `register(adapter)`."""


@hookspec
def mstar_register_routes(register: Callable[[Any], None]) -> None:
    """Add a package's own HTTP/WebSocket routes: `register(make_router)`, a no-argument callable returning a fastapi.APIRouter."""


@hookspec
def mstar_register_compositions(register: Callable[[Any], None]) -> None:
    """Register kinds of composed model (built from loaded models' nodes): `register(spec)`, a `mstar_core.compose.CompositionSpec`."""
