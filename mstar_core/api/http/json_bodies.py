"""JSON bodies parsed at orjson's speed, the large ones in the off-loop pool (`OffLoopJsonRoute`, `json_router`), as
Python's parser reads them.

FastAPI parses a body with `json.loads` on the event loop, then validates it there: for a 12 MB body that held the
loop ~0.3 s on a loaded machine, and a burst of a few 200 KB tool lists held it 30 ms. The route class parses every
JSON body first (orjson, with `json.loads` deciding wherever the two could differ) and hands FastAPI the result,
which it caches and reuses: inline below `POOL_BYTES` (a thread hop costs more), in the pool from there on.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response
from fastapi.routing import APIRoute

#: From this size a JSON body is parsed in the pool. Measured on the 2-core EPYC for 62 KB of nested tool schemas:
#: orjson 0.27 ms, and the check for integers past 64 bits (Python walking the parsed values) 0.7 ms more.
POOL_BYTES = 64 * 1024

#: The scope key where the guard middleware (`mstar_core.api.server.middleware`) leaves the body it read.
BODY_KEY = "mstar.body"


def loads(body: bytes | str) -> Any:
    """JSON exactly as Python's parser reads it, at orjson's speed where the two agree. orjson refuses NaN and
    Infinity literals, numbers past a double and lone surrogates, and reads integers past 64 bits as floats: any of
    those sends the body to `json.loads`, which decides (a float of integral value past 2**63 may have been such
    an integer; checking the parsed values is Python code, so a thread running it lets the loop have its turns)."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return json.loads(body)
    return json.loads(body) if _maybe_big_int(parsed) else parsed


_INT64 = float(2**63)


def _maybe_big_int(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, float) and abs(item) >= _INT64 and item.is_integer():
            return True
    return False


async def parse_json_body(request: Any) -> None:
    """A JSON body parsed before FastAPI reads it (it caches `request._json` and reuses it): inline when small, in the
    pool from `POOL_BYTES`. A body that is not JSON raises the error FastAPI raises for it (a 400 naming the
    position), without a second parse on the loop."""
    if request.method not in ("POST", "PUT", "PATCH"):
        return
    content_type = request.headers.get("content-type", "")
    if content_type and "json" not in content_type.split(";", 1)[0].lower():
        return  # a form or an upload: not parsed as JSON
    body = request.scope.get(BODY_KEY)  # what the guard middleware read: Starlette's body() would copy it
    if body is None:
        body = await request.body()
    else:
        request._body = body  # (FastAPI reads it from here too)
    if not body:
        return  # FastAPI's own answer for a missing body
    try:
        request._json = await asyncio.to_thread(loads, body) if len(body) >= POOL_BYTES else loads(body)
    except json.JSONDecodeError as exc:
        from fastapi.exceptions import RequestValidationError

        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": exc.msg}}], body=exc.doc) from exc
    except (UnicodeDecodeError, RecursionError):
        return  # FastAPI answers these as it always has


class OffLoopJsonRoute(APIRoute):
    """A FastAPI route whose JSON bodies are parsed by `parse_json_body` (orjson; the large ones off the loop)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        takes_body = self.body_field is not None  # (a route without a body parameter never reads one)

        async def handle(request: Request) -> Response:
            if takes_body:
                await parse_json_body(request)
            return await handler(request)

        return handle


def json_router() -> APIRouter:
    """An APIRouter whose routes parse JSON bodies with orjson, the large ones off the loop."""
    return APIRouter(route_class=OffLoopJsonRoute)
