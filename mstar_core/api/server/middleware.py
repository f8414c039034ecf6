"""Pure-ASGI middleware: API key, body size limit, request metrics (streaming-safe, unlike BaseHTTPMiddleware)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from typing import Any

import orjson

from mstar_core.api.http.errors import error_body
from mstar_core.api.http.json_bodies import BODY_KEY

#: Routes that answer without the API key.
#: Paths answered without the API key: health probes, and the playground's page and files (they hold no data;
#: the page sends the key the user types on every API call)
OPEN_PATHS = frozenset({"/health", "/"})
OPEN_PREFIXES = ("/playground/",)


class GuardMiddleware:
    """Checks the API key, bounds the body, and counts every response by model, route and status."""

    def __init__(self, app: Any, state: Any):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        config = self.state.config
        path = scope.get("path", "")
        started = time.perf_counter()
        status_box = [0]

        async def send_tracking(message):
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
            await send(message)

        try:
            open_path = path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)
            if config.api_key and not open_path and not self._authorized(scope, config.api_key):
                await _reply(send_tracking, 401, "missing or wrong API key; send 'Authorization: Bearer <key>'",
                             {"www-authenticate": "Bearer"})
                return
            if scope.get("method") in ("POST", "PUT", "PATCH"):
                limit = config.body_limit(path)
                body = await self._read_body(scope, receive, limit)
                if body is None:
                    await _drain(scope, receive, DRAIN_FACTOR * limit)
                    await _reply(send_tracking, 413, f"request body is larger than the server's limit of {limit} bytes",
                                 {"connection": "close"})
                    return
                receive = _replay(body, receive)
                scope[BODY_KEY] = body  # read once: the route's parser takes it from here, without another copy
            await self.app(scope, receive, send_tracking)
        finally:
            metrics = self.state.metrics
            if metrics is not None and status_box[0] and path not in ("/metrics", "/health"):
                model = (scope.get("state") or {}).get("model", "-")
                route = self.state.route_label(path)
                metrics.observe_request(model, route, status_box[0], time.perf_counter() - started)

    @staticmethod
    def _authorized(scope, key: str) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
        return False

    @staticmethod
    async def _read_body(scope, receive, limit: int) -> bytes | None:
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    if int(value) > limit:
                        return None
                except ValueError:
                    pass
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


#: An oversized body is read and dropped (up to this many times the body limit, for at most DRAIN_SECONDS) before
#: the 413 goes out. Answered at once, a client that writes its whole body before reading (most do) and takes
#: longer than the server's keep-alive timeout (5 s) to send it has its socket closed with bytes unread: the
#: kernel then resets the connection and the 413 is lost. Beyond either bound the server stops reading.
DRAIN_FACTOR = 8
DRAIN_SECONDS = 60.0


async def _drain(scope, receive, cap: int) -> None:
    """Read and drop the rest of a refused body (bounded in bytes and time), so the reply is not lost to a reset."""
    for name, value in scope.get("headers", ()):
        if name == b"expect" and value.lower() == b"100-continue":
            return  # the client waits for our answer before sending the body: it reads the 413 at once
    dropped = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DRAIN_SECONDS):
            while dropped <= cap:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                dropped += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return


def _replay(body: bytes, receive):
    """A receive() that hands the buffered body over once, then waits for the real disconnect."""
    sent = [False]

    async def replay():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _reply(send, status: int, message: str, headers: dict[str, str] | None = None) -> None:
    payload = orjson.dumps(error_body(status, message))
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload})
