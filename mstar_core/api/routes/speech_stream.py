"""`WS /v1/audio/speech/stream?model=NAME`: text in pieces (as an LLM writes it), speech out as soon as a segment of
it can be spoken.

Client events (JSON text frames):
- `{"type": "session.update", "session": {"voice", "instructions", "response_format": "pcm", ...speech extras}}`:
  how to speak (a preset speaker or a cloned voice's id, as on `/v1/audio/speech`); before the first text;
- `{"type": "input_text.append", "text": "..."}`: more text; `TextChunker` cuts it at sentence ends, at clause
  boundaries once a segment has a few words, or after a word count, and each segment is spoken at once;
- `{"type": "input_text.flush"}`: the text so far is complete: its tail is spoken too, then `flush.done`;
- `{"type": "cancel"}`: drop the text not yet spoken and stop the segment being spoken (`cancelled`).
Server events: `segment.started` {segment, text}, `audio.delta` {segment, audio: base64 s16le mono at the model's
rate}, `segment.done` {segment}, `flush.done`, `cancelled`, `error` {error: {message, param, code}}. Segments are
spoken one after another in order; the session ends when the client closes it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
from typing import Any

import orjson
from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect

from mstar_core.api.http.errors import ApiError
from mstar_core.api.requests.submit import submit
from mstar_core.api.requests.text_chunks import TextChunker
from mstar_core.api.requests.voices import caller_scope, is_voice_id
from mstar_core.errors import RequestCancelled, RequestError

router = APIRouter()
PATH = "/v1/audio/speech/stream"
#: The most text a session may hold unspoken (characters): a client that only appends is bounded.
MAX_PENDING_CHARS = 16384
_SESSION_KEYS = {"voice", "instructions", "response_format", "seed", "temperature", "top_p", "top_k", "language",
                 "max_frames", "do_sample", "subtalker_dosample"}


def _authorized(ws: WebSocket, key: str) -> bool:
    scheme, _, token = ws.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def _error(message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"type": "error", "error": {"message": message, "param": param, "code": code}}


class SpeechStreamSession:
    """One socket's text buffer, its queue of segments and the one being spoken."""

    def __init__(self, ws: WebSocket, state: Any, model: str, adapter: Any):
        self.ws, self.state, self.model, self.adapter = ws, state, model, adapter
        self.scope = caller_scope(ws.headers)
        self.chunker = TextChunker()
        self.settings: dict[str, Any] = {}
        self.segments: asyncio.Queue[tuple[int, str] | str] = asyncio.Queue()
        self.count = 0
        self.current: Any = None  # the handle being spoken

    async def send(self, payload: dict[str, Any]) -> None:
        await self.ws.send_text(orjson.dumps(payload).decode())

    def configure(self, session: Any) -> None:
        if not isinstance(session, dict):
            raise ApiError(400, "'session' must be an object", param="session")
        unknown = sorted(set(session) - _SESSION_KEYS)
        if unknown:
            raise ApiError(400, f"unknown session field(s) {unknown}; known: {sorted(_SESSION_KEYS)}",
                           param=f"session.{unknown[0]}")
        if session.get("response_format", "pcm") != "pcm":
            raise ApiError(400, "the stream sends raw s16le audio: 'response_format' must be pcm",
                           param="session.response_format")
        voice = session.get("voice")
        if is_voice_id(voice):
            self.state.voices.get(self.scope, voice, param="session.voice")  # this key's own voice, or a 404 now
        self.settings = {k: v for k, v in session.items() if k != "response_format"}

    def queue(self, pieces: list[str]) -> None:
        for text in pieces:
            if text.strip():
                self.segments.put_nowait((self.count, text.strip()))
                self.count += 1

    def inputs(self, text: str) -> dict[str, Any]:
        payload = {"model": self.model, **self.settings, "input": text}
        if is_voice_id(payload.get("voice")):
            voice = self.state.voices.get(self.scope, payload["voice"], param="session.voice")
            payload["voice"], payload["cloned_voice"] = None, dict(voice.prompt)
        elif payload.get("voice") is None:
            payload["voice"] = self.adapter.field_default("speech", "voice")
        return self.adapter.speech_inputs(payload)

    async def speak(self) -> None:
        """Speak the queued segments in order (a string in the queue marks a flush to acknowledge)."""
        while True:
            item = await self.segments.get()
            if isinstance(item, str):
                await self.send({"type": item})
                continue
            index, text = item
            await self.send({"type": "segment.started", "segment": index, "text": text})
            try:
                self.current = await submit(self.state, self.model, self.inputs(text))
                async for out in self.current:
                    if out.name == self.adapter.audio_output:
                        pcm = self.adapter.audio_chunk(out.value)
                        if pcm.size:
                            await self.send({"type": "audio.delta", "segment": index,
                                             "audio": base64.b64encode(pcm.astype("<i2").tobytes()).decode()})
                await self.current.result()
                await self.send({"type": "segment.done", "segment": index})
            except asyncio.CancelledError:
                raise
            except RequestCancelled:
                pass  # `cancel`: its event says so
            except (ApiError, RequestError) as exc:
                status = getattr(exc, "message", str(exc))
                await self.send(_error(status, getattr(exc, "param", None), getattr(exc, "code", None)))
            except Exception as exc:  # a failed segment fails alone; the session goes on
                await self.send(_error(f"segment {index} failed: {exc}", code="segment_failed"))
            finally:
                self.current = None

    async def cancel(self) -> None:
        self.chunker.cancel()
        while not self.segments.empty():
            self.segments.get_nowait()
        if self.current is not None:
            self.current.cancel()


@router.websocket(PATH)
async def speech_stream(ws: WebSocket) -> None:
    state = ws.app.state.mstar
    if state.config.api_key and not _authorized(ws, state.config.api_key):
        await ws.close(code=1008, reason="missing or wrong API key; send 'Authorization: Bearer <key>'")
        return
    await ws.accept()
    model = ws.query_params.get("model")
    try:
        if not model:
            raise ApiError(400, "'model' is required: connect to /v1/audio/speech/stream?model=NAME", param="model")
        adapter = state.adapter(model, "speech")
    except ApiError as exc:
        with contextlib.suppress(Exception):
            await ws.send_text(orjson.dumps(_error(exc.message, exc.param, exc.code)).decode())
            await ws.close(code=1008, reason=exc.message[:120])
        return
    session = SpeechStreamSession(ws, state, model, adapter)
    speaker = asyncio.ensure_future(session.speak())
    try:
        while True:
            message = await ws.receive_text()
            try:
                await _handle(session, message)
            except (ApiError, RequestError) as exc:
                await session.send(_error(getattr(exc, "message", str(exc)), getattr(exc, "param", None),
                                          getattr(exc, "code", None)))
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass  # the client went away
    finally:
        speaker.cancel()
        with contextlib.suppress(BaseException):
            await session.cancel()
        with contextlib.suppress(Exception):
            await ws.close()


async def _handle(session: SpeechStreamSession, message: str) -> None:
    try:
        event = orjson.loads(message)
    except orjson.JSONDecodeError:
        raise ApiError(400, "each message must be a JSON object", param="type") from None
    kind = event.get("type") if isinstance(event, dict) else None
    if kind == "session.update":
        session.configure(event.get("session"))
    elif kind == "input_text.append":
        text = event.get("text")
        if not isinstance(text, str):
            raise ApiError(400, "'text' must be a string", param="text")
        if len(session.chunker.buffer) + len(text) > MAX_PENDING_CHARS:
            raise ApiError(400, f"more than {MAX_PENDING_CHARS} characters wait unspoken: flush first", param="text")
        session.queue(session.chunker.push(text))
    elif kind == "input_text.flush":
        session.queue(session.chunker.flush())
        session.segments.put_nowait("flush.done")
    elif kind == "cancel":
        await session.cancel()
        await session.send({"type": "cancelled"})
    else:
        raise ApiError(400, f"unknown event type {kind!r}: session.update, input_text.append, input_text.flush or "
                            "cancel", param="type")
