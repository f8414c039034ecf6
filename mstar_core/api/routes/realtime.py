"""`/v1/realtime?model=NAME`: the WebSocket endpoint (handshake, admission, receive loop, sender, clean-up).

Close codes: 1008 for a missing or wrong API key (refused before the handshake completes, so the client sees
HTTP 403) and for a client that stops reading; 1013 (try again later) when the server is loading, draining or
full (the session limit, or no admission place); 1000 when the session's time or idle bound passes. Every
close after the handshake follows an `error` event saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from typing import Any

import orjson
from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect

from mstar_core.api.http.errors import ApiError
from mstar_core.api.realtime.bridge import ModelBridge
from mstar_core.api.realtime.closing import close_bounded
from mstar_core.api.realtime.limits import RealtimeLimits
from mstar_core.api.realtime.protocol import ClientTooSlow, EventError, error_event
from mstar_core.api.realtime.session import RealtimeSession
from mstar_core.api.realtime.vad import silero_model, silero_pending
from mstar_core.errors import RequestError

log = logging.getLogger("mstar.api.realtime")
router = APIRouter()
PATH = "/v1/realtime"


def _authorized(ws: WebSocket, key: str) -> bool:
    scheme, _, token = ws.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def _sessions(state: Any) -> set[Any]:
    sessions = getattr(state, "realtime_sessions", None)
    if sessions is None:
        sessions = state.realtime_sessions = set()
    return sessions


def _admission_place(state: Any) -> Any:
    """One admission place for the session's life (the server's admission, where it has one)."""
    admission = getattr(state.engine, "admission", None)
    if admission is not None:
        return admission.take()  # raises RequestError (503) when full
    limit = state.config.max_inflight
    if limit and state.inflight + len(_sessions(state)) >= limit:
        raise RequestError(f"the server is at capacity ({state.inflight} requests in flight)", status=503)
    return None


async def _refuse(ws: WebSocket, code: int, message: str, error_code: str, param: str | None = None) -> None:
    err = EventError(message, param=param, code=error_code,
                     type="server_error" if code == 1013 else "invalid_request_error")
    with contextlib.suppress(Exception):
        await ws.send_text(orjson.dumps(error_event(err, None)).decode())
        await ws.close(code=code, reason=message[:120])


@router.websocket(PATH)
async def realtime_socket(ws: WebSocket) -> None:
    state = ws.app.state.mstar
    if state.config.api_key and not _authorized(ws, state.config.api_key):
        await ws.close(code=1008, reason="missing or wrong API key; send 'Authorization: Bearer <key>'")
        return
    limits = RealtimeLimits.from_env()
    await ws.accept()
    if not state.ready or state.draining:
        await _refuse(ws, 1013, "the server is loading or shutting down; retry shortly", "server_not_ready")
        return
    model = ws.query_params.get("model")
    if not model:
        await _refuse(ws, 1008, "'model' is required: connect to /v1/realtime?model=NAME", "missing_model", "model")
        return
    try:
        bridge = ModelBridge(state, model)
    except ApiError as exc:
        await _refuse(ws, 1008, exc.message, exc.code or "model_not_found", "model")
        return
    except EventError as exc:
        await _refuse(ws, 1008, exc.message, exc.code or "model_not_supported", "model")
        return
    if silero_pending():  # the first session's turn detector: its model loads off the loop (before the checks
        await asyncio.to_thread(silero_model)  # below: nothing is awaited between a place taken and its session)
    sessions = _sessions(state)
    if len(sessions) >= limits.max_sessions:
        await _refuse(ws, 1013, f"the server holds its limit of {limits.max_sessions} realtime sessions; retry later",
                      "server_overloaded")
        return
    try:
        place = _admission_place(state)
    except RequestError as exc:
        await _refuse(ws, 1013, f"{exc}; retry later", "server_overloaded")
        return

    async def send(payload: dict[str, Any]) -> None:
        await ws.send_text(orjson.dumps(payload).decode())

    session = RealtimeSession(state, bridge, limits, send, detector=False)  # its detector: below, off the loop
    sessions.add(session)
    sender = asyncio.ensure_future(session.sender())
    # its failure is read by the receive loop when it ends the session; one that comes after (a write cut short
    # as the client leaves, even once cancelled) is not news: read here, so asyncio does not log it as unretrieved
    sender.add_done_callback(lambda task: task.cancelled() or task.exception())
    try:
        await session.make_detector()
        await session.start()
        await _receive_loop(ws, session, sender, limits)
    except ClientTooSlow as exc:
        log.info("realtime session %s: %s; closing", session.id, exc)
        too_slow = str(exc)
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass  # the client went away: everything is freed below
    else:
        too_slow = None
    finally:
        # the session's slot, queue and media are freed before the close: a client that never reads cannot take
        # the close frame either, and waiting for it to drain would keep them for ever
        await session.close()
        sender.cancel()
        sessions.discard(session)
        if place is not None:
            place.release()
    await close_bounded(ws, 1008 if too_slow else 1000, (too_slow or "")[:120])


async def _receive_loop(ws: WebSocket, session: RealtimeSession, sender: asyncio.Task, limits: RealtimeLimits) -> None:
    opened = time.monotonic()
    while True:
        left = limits.max_session_seconds - (time.monotonic() - opened)
        if left <= 0:
            await _end(ws, session, f"the session reached its limit of {limits.max_session_seconds:g} s",
                       "session_expired")
            return
        receive = asyncio.ensure_future(ws.receive())
        stop = asyncio.ensure_future(session.stopped.wait())
        done, _ = await asyncio.wait({receive, sender, stop}, timeout=min(limits.idle_seconds, left),
                                     return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if stop in done:
            receive.cancel()
            raise ClientTooSlow(f"the client read no events for {limits.send_timeout:g} s")
        if sender in done:  # writing failed (the client went away) or the client stopped reading
            receive.cancel()
            exc = sender.exception() if not sender.cancelled() else None
            if isinstance(exc, ClientTooSlow):
                raise exc
            return
        if receive not in done:
            receive.cancel()
            if time.monotonic() - opened < limits.max_session_seconds:
                await _end(ws, session, f"no client event for {limits.idle_seconds:g} s", "session_idle")
                return
            continue
        message = receive.result()
        if message["type"] == "websocket.disconnect":
            return
        await _one_event(session, message, limits)


async def _one_event(session: RealtimeSession, message: dict[str, Any], limits: RealtimeLimits) -> None:
    text, event_id = message.get("text"), None
    try:
        if text is None:
            raise EventError("send each client event as a JSON text frame", code="invalid_frame")
        if len(text) > limits.max_event_bytes:
            raise EventError(f"the event is {len(text)} bytes; this server takes at most {limits.max_event_bytes} "
                             "per event (split input_audio_buffer.append)", code="event_too_large")
        try:
            ev = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise EventError(f"the event is not valid JSON ({exc})", code="invalid_json") from None
        if not isinstance(ev, dict):
            raise EventError("an event must be a JSON object with a 'type'", param="type", code="invalid_event")
        event_id = ev.get("event_id") if isinstance(ev.get("event_id"), str) else None
        await session.handle(ev)
    except EventError as exc:
        await session.emit(error_event(exc, event_id))


async def _end(ws: WebSocket, session: RealtimeSession, message: str, code: str) -> None:
    with contextlib.suppress(Exception):
        await session.emit(error_event(EventError(message, code=code), None))
        await asyncio.sleep(0.05)  # let the sender write it
    await close_bounded(ws, 1000, message[:120])
