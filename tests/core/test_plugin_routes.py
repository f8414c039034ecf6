"""`mstar_register_routes` (issue 26): a model package adds its own HTTP and WebSocket routes to the server."""

from __future__ import annotations

import types

import pytest
from fastapi import WebSocket  # module level: the route's annotation is resolved from these globals

from mstar_core.errors import ConfigError
from mstar_core.plugins import hookimpl
from mstar_core.plugins.manager import discover


@pytest.fixture(autouse=True)
def only_the_core(monkeypatch):
    """Installed plugins stay out (pi0's package adds a route of its own); each test registers its own."""
    monkeypatch.setenv("MSTAR_PLUGINS", "core")


def _plugin(name: str, make_router) -> types.ModuleType:
    module = types.ModuleType(name)
    module.mstar_register_routes = hookimpl(lambda register: register(make_router))
    return module


def _toy_router():
    from fastapi import APIRouter

    router = APIRouter()

    @router.get("/v1/toy/ping")
    async def ping():
        return {"pong": True}

    @router.websocket("/v1/toy/echo")
    async def echo(ws: WebSocket):
        await ws.accept()
        await ws.send_text((await ws.receive_text()).upper())
        await ws.close()

    return router


def _app(registry):
    from mstar_core.api.server.app import ServerConfig, create_app
    from mstar_core.runtime import AsyncEngine

    return create_app(ServerConfig(), lambda: AsyncEngine(registry), registry=registry)


def test_a_plugins_http_and_websocket_routes_are_served_beside_the_cores():
    from fastapi.testclient import TestClient

    registry = discover(extra_modules=[_plugin("toy_routes", _toy_router)])
    assert [origin for origin, _ in registry.routers] == ["toy_routes"]
    with TestClient(_app(registry)) as client:
        assert client.get("/v1/toy/ping").json() == {"pong": True}
        with client.websocket_connect("/v1/toy/echo") as ws:
            ws.send_text("hello")
            assert ws.receive_text() == "HELLO"
        assert client.get("/v1/models").status_code == 200  # the core's routes are still there


def test_a_route_the_core_serves_is_a_startup_error_naming_the_plugin_and_route():
    def shadow():
        from fastapi import APIRouter

        router = APIRouter()
        router.get("/health")(lambda: {"status": "mine"})
        return router

    registry = discover(extra_modules=[_plugin("shadowing", shadow)])
    with pytest.raises(ConfigError, match=r"plugin shadowing adds route GET /health, which the core already serves"):
        _app(registry)


def test_a_route_of_a_router_the_core_includes_is_taken_too():
    def shadow():
        from fastapi import APIRouter

        router = APIRouter()
        router.post("/v1/audio/speech")(lambda: {})
        return router

    registry = discover(extra_modules=[_plugin("speech_thief", shadow)])
    with pytest.raises(ConfigError, match=r"plugin speech_thief adds route POST /v1/audio/speech, which the core"):
        _app(registry)


def test_a_factory_returning_no_router_is_a_startup_error_naming_the_plugin():
    registry = discover(extra_modules=[_plugin("not_a_router", lambda: {"GET /x": None})])
    with pytest.raises(ConfigError, match="plugin not_a_router's mstar_register_routes factory returned dict"):
        _app(registry)


def test_registering_something_not_callable_fails_that_plugin_only():
    registry = discover(extra_modules=[_plugin("bad_routes", "/v1/toy"), _plugin("toy_routes", _toy_router)])
    failed = {p.name: p.error for p in registry.failed()}
    assert "no-argument callable" in failed["bad_routes"] and "mstar_register_routes" in failed["bad_routes"]
    assert [origin for origin, _ in registry.routers] == ["toy_routes"]


def test_pi0s_websocket_comes_from_its_package_not_the_core(monkeypatch):
    import importlib.util

    assert importlib.util.find_spec("mstar_core.api.policy_ws") is None
    monkeypatch.setenv("MSTAR_PLUGINS", "pi05")
    registry = discover()
    origins = [origin for origin, _ in registry.routers]
    assert "pi05" in origins
    router = dict(registry.routers)["pi05"]()
    assert [getattr(r, "path", None) for r in router.routes] == ["/"]
