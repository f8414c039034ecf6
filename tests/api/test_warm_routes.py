"""FastAPI builds each route's validators the first time a request walks past it; the server has them built before
it listens (`warm_routes`), so no request pays for them on the event loop."""

from __future__ import annotations

import pydantic
from fastapi.testclient import TestClient

from mstar_core.api.server.app import ServerConfig, create_app


def test_the_first_requests_build_no_validators(tmp_path, monkeypatch):
    app = create_app(ServerConfig(state_dir=str(tmp_path)), engine_factory=lambda: None)
    built: list[object] = []
    real = pydantic.TypeAdapter.__init__

    def counting(self, *args, **kwargs):
        built.append(args[0] if args else kwargs.get("type"))
        real(self, *args, **kwargs)

    with TestClient(app) as client:
        monkeypatch.setattr(pydantic.TypeAdapter, "__init__", counting)
        answers = [client.post("/v1/chat/completions", json={"model": "x"}).status_code,
                   client.post("/v1/responses", json={"model": "x"}).status_code,
                   client.get("/v1/files").status_code, client.get("/v1/batches").status_code,
                   client.get("/nowhere").status_code]
    assert answers[-1] == 404 and all(code < 500 or code == 503 for code in answers), answers
    assert built == [], f"validators built while serving: {built[:5]}"


def test_without_the_warm_up_the_first_request_builds_them(tmp_path, monkeypatch):
    """The check above can fail: with `warm_routes` skipped, the first request builds validators."""
    async def skip(_app):
        return None

    monkeypatch.setattr("mstar_core.api.server.app.warm_routes", skip)
    app = create_app(ServerConfig(state_dir=str(tmp_path)), engine_factory=lambda: None)
    built: list[object] = []
    real = pydantic.TypeAdapter.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        real(self, *args, **kwargs)

    with TestClient(app) as client:
        monkeypatch.setattr(pydantic.TypeAdapter, "__init__", counting)
        client.post("/v1/chat/completions", json={"model": "x"})
    assert built
