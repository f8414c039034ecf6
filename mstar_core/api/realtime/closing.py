"""Closing a realtime socket without waiting on the client: a client that reads nothing never takes the close
frame, so the close is bounded in time and the connection then dropped."""

from __future__ import annotations

import asyncio

from starlette.websockets import WebSocket

#: Seconds a close may wait for the socket to take the close frame (a client that reads nothing never does).
CLOSE_TIMEOUT_S = 2.0


async def close_bounded(ws: WebSocket, code: int, reason: str = "") -> None:
    """Close the socket, giving up after CLOSE_TIMEOUT_S; the connection is then dropped under the client."""
    try:
        await asyncio.wait_for(ws.close(code=code, reason=reason), CLOSE_TIMEOUT_S)
    except TimeoutError:
        _abort(ws)
    except Exception:  # already closed, or the client went away meanwhile
        pass


def _abort(ws: WebSocket) -> None:
    """Drop the connection (its unsent bytes with it): the ASGI server's transport, reached through its bound send
    (uvicorn's protocols keep it as `transport`) under the wrappers Starlette puts around that send. Nothing is done
    where none is found: the session is already freed, and the server closes the socket when it can."""
    seen, todo = set(), [getattr(ws, "_send", None)]
    while todo and len(seen) < 16:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        transport = getattr(getattr(fn, "__self__", None), "transport", None)
        if transport is not None and hasattr(transport, "abort"):
            transport.abort()
            return
        todo += [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if callable(c.cell_contents)]
