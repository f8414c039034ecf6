"""One batch line through the app itself, in this process: the same middleware (API key, body bound, metrics),
route, request pipeline and engine as a live request, with the request marked background
(`requests.submit.PRIORITY_STATE`) so the schedulers serve live calls first."""

from __future__ import annotations

import asyncio
from typing import Any

from mstar_core.api.requests.submit import PRIORITY_STATE


class InProcessDispatch:
    """`await dispatch(url, body, cancelled)` -> (HTTP status, response body bytes) from `app` (an ASGI app).

    `api_key`: what the line sends as its bearer token (the server's own key, when it has one). When
    `cancelled` is set the route sees its client disconnect, so the request is cancelled as a live one is.
    """

    def __init__(self, app: Any, api_key: str | None, priority: float):
        self.app = app
        self.api_key = api_key
        self.priority = priority

    async def __call__(self, url: str, body: bytes, cancelled: asyncio.Event) -> tuple[int, bytes]:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"host", b"mstar-batch")]
        if self.api_key:
            headers.append((b"authorization", f"Bearer {self.api_key}".encode()))
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": url, "raw_path": url.encode(), "query_string": b"",
                 "root_path": "", "headers": headers, "client": ("127.0.0.1", 0), "server": ("mstar-batch", 0),
                 "state": {PRIORITY_STATE: self.priority}}
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await cancelled.wait()
            return {"type": "http.disconnect"}

        status = 500
        chunks: list[bytes] = []

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, send)
        return status, b"".join(chunks)
