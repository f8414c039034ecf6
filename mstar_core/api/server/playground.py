"""The playground at `/` (static HTML, JS and CSS shipped with the package: no build step), and
`GET /v1/graphs/{model}`: each walk drawn as Mermaid and DOT, with the model's example request."""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from mstar_core.api.http.errors import ApiError
from mstar_core.api.requests.schemas import ERROR_RESPONSES

router = APIRouter()

#: The playground's files (package data of `mstar_core`) and the content type each is served as.
ASSETS = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
          "walks.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}


def _asset(name: str) -> bytes:
    return resources.files("mstar_core").joinpath("playground", name).read_bytes()


@router.get("/", include_in_schema=False)
async def playground_page(request: Request) -> Response:
    # whether the API wants a key (never the key): the page asks for one before its first call instead of a 401
    needs_key = "required" if request.app.state.mstar.config.api_key else "none"
    page = _asset("index.html").replace(b'content="mstar-auth"', f'content="{needs_key}"'.encode())
    return Response(page, media_type=ASSETS["index.html"], headers={"Cache-Control": "no-cache"})


@router.get("/playground/{name}", include_in_schema=False)
async def playground_asset(name: str) -> Response:
    if name not in ASSETS:
        raise ApiError(404, f"no playground file '{name}'")
    return Response(_asset(name), media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})


@router.get("/v1/graphs/{model}", responses=ERROR_RESPONSES, summary="A model's walks drawn (Mermaid and DOT)")
async def model_graphs(model: str, request: Request) -> dict[str, Any]:
    from mstar_core.api.media.tensors import encode_value
    from mstar_core.graph.render import to_dot, to_mermaid

    request.state.model = model
    loaded = request.app.state.mstar.loaded(model)
    graph = loaded.graph
    walks = {name: {"mermaid": to_mermaid(graph, name), "dot": to_dot(graph, name),
                    "description": getattr(walk, "description", "") or ""}
             for name, walk in sorted(graph.walks.items())}
    example = getattr(loaded, "example", None)
    return {"model": model, "walks": walks, "example": encode_value(dict(example)) if example else None}
